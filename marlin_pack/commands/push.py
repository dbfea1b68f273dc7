"""``marlin-pack push``: publish a bundle to object storage (``s3://bucket/prefix``, ``gs://bucket/prefix``), said in one line."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from marlin_pack.commands.console import out, progress, styled
from marlin_pack.commands.params import JsonOpt, RevisionOpt, TargetArg, bundle_of

__all__ = ["push"]


def push(
    target: TargetArg,
    url: Annotated[str, typer.Argument(metavar="URL", help="Where to publish it: s3://BUCKET/PREFIX or gs://BUCKET/PREFIX.")],
    force: Annotated[bool, typer.Option("--force", help="Replace another bundle published at URL (its readers are refused "
                                        "until this one is complete, never given a mix).")] = False,
    revision: RevisionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish a bundle to object storage, for engines to stream (credentials and AWS_ENDPOINT_URL as boto3 reads them; gs:// with application-default credentials, or an HMAC key in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY with MARLIN_PACK_GCS_HMAC=1).

    The bundle is proven against its manifest first; the files go up, then the manifest, then the publication record: readers never see a half-written bundle. Pushing the same bundle again writes nothing.

    Examples:

      marlin-pack push ./Llama-3-8B-AWQ s3://models/llama-3-8b-awq

      AWS_ENDPOINT_URL=http://minio:9000 marlin-pack push ./Llama-3-8B-AWQ/marlin-pack s3://models/llama-3-8b-awq

      marlin-pack push ./Llama-3-8B-AWQ gs://models/llama-3-8b-awq    # GCS, application-default credentials
    """  # noqa: E501
    from marlin_pack.remote.push import push as run_push
    from marlin_pack.remote.url import parse_url

    parse_url(url)  # a bad URL before any work
    bundle, _ = bundle_of(target, revision)
    with progress(not as_json, "proving") as update:
        result = run_push(bundle, url, force=force, progress=update)
    if as_json:
        out.print_json(json.dumps({"url": result.url, "up_to_date": result.up_to_date, "uploaded": result.uploaded,
                                   "kept": result.kept, "bytes_uploaded": result.bytes_uploaded, "replaced": result.replaced}))
        return
    word = ("up to date", "green") if result.up_to_date else ("pushed", "green")
    out.print(styled(word, f" {result.summary()}"), soft_wrap=True, highlight=False)
