"""Bundles in object storage (``s3://bucket/prefix``): URLs told apart from paths, publishing, ranged reads.

``url.py`` (no client import) says what is a URL and refuses one where a path is expected; the modules that talk to a
bucket import their clients (boto3, Run:ai's streamer: the ``s3`` extra) only when called.
"""
