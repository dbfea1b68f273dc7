"""The bundle on disk, owned in one place: its paths and rank files, how it is written, read and checked.

``reader``: find a bundle and parse its manifest. ``rank_files``: what each rank file is
named, carries as metadata and holds (the rule the writer, ``verify`` and the loader share).
``integrity``: sizes, hashes and stamps of the bundle's files and of its source checkpoint.
``writer``: :class:`~marlin_pack.bundle.writer.BundleWriter` (temporary directory, streamed
files, manifest, stamps, atomic publish); ``in_place``: its publish into an existing output directory, entry by entry.
``existing``: what ``convert`` finds at its output and does about it (keep, add, rewrite, refuse). The manifest
schema itself is ``marlin_pack.schemas``.
"""
