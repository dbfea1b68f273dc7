"""Reading a published bundle on the CPU, against a real S3 server: each rank's tensors byte for byte as the local
bundle's, only its own byte ranges (a pipeline stage only its layers'), every block verified; every refusal in one line
(bad credentials, a missing object, a truncated object, a bundle re-published between the plan and the read, a
half-published bundle)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from marlin_pack._constants import MANIFEST_NAME
from marlin_pack.errors import BundleError, BundleMismatchError
from marlin_pack.remote.bundle import open_remote, plan_rank
from marlin_pack.remote.push import push
from marlin_pack.remote.record import RECORD_NAME
from marlin_pack.remote.store import RemoteError
from marlin_pack.remote.stream import HostSink, read_rank

BLOCK = 64 << 10  # the tiny bundles' rank files are ~10 blocks of this


@pytest.fixture
def published(make_bundle, s3):  # type: ignore[no-untyped-def]
    """The tiny AWQ model with a TP 1,2 bundle, published in small blocks: (model_dir, url)."""
    model = make_bundle("awq", group_size=32, tp_sizes=(1, 2))
    push(model / "marlin-pack", s3.url("llama"), block_size=BLOCK)
    return model, s3.url("llama")


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_rank_tensors_byte_exact_and_only_its_own_files(published, tp: int, rank: int) -> None:  # type: ignore[no-untyped-def]
    model, url = published
    plan = plan_rank(open_remote(url), tp, rank)
    sink = HostSink(plan)
    done = read_rank(plan, sink)
    rank_path = f"tp{tp}/rank-{rank}.safetensors"
    assert set(done.bytes_read) == {rank_path, "common.safetensors"}  # never another rank's file
    for path in done.bytes_read:
        local = load_file(model / "marlin-pack" / path)
        got = sink.tensors(path)
        assert set(got) == set(local)
        for name, tensor in local.items():
            assert got[name].dtype == tensor.dtype and torch_equal_bytes(got[name], tensor), name
        size = (model / "marlin-pack" / path).stat().st_size
        assert done.bytes_read[path] == size  # a whole rank reads its whole files, once each
    assert done.total == plan.read_bytes - sum(f.header_bytes for f in plan.files)
    assert done.blocks == sum(-(-(e - s) // BLOCK) for f in plan.files for s, e in f.spans)


def torch_equal_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8))


def test_a_pipeline_stage_reads_only_its_layers(published) -> None:  # type: ignore[no-untyped-def]
    model, url = published
    bundle = open_remote(url)
    whole = plan_rank(bundle, 1, 0)
    stages = [plan_rank(bundle, 1, 0, pp_size=2, pp_rank=s, model_dir=model) for s in (0, 1)]
    local = load_file(model / "marlin-pack" / "tp1/rank-0.safetensors")
    seen: set[str] = set()
    for plan in stages:
        sink = HostSink(plan)
        done = read_rank(plan, sink)
        rank = plan.files[0]
        assert done.bytes_read[rank.entry.path] < rank.entry.size  # a share of the rank file, not all of it
        assert rank.tensor_bytes <= rank.span_bytes <= rank.tensor_bytes + 2 * BLOCK * len(rank.spans)
        got = sink.tensors(rank.entry.path)
        assert got and all(torch_equal_bytes(got[n], local[n]) for n in got)
        layers = {n.split(".")[2] for n in got}
        assert len(layers) == 1 and not seen & set(got)  # one layer each, none read by both
        seen |= set(got)
    assert seen == set(local)
    assert sum(p.files[0].tensor_bytes for p in stages) == whole.files[0].tensor_bytes
    assert "stage 1/2 reads" in stages[1].text()


def test_bad_credentials(published, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    _, url = published
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAKEY000000000")
    with pytest.raises(RemoteError, match=r"^cannot read s3://.*/llama/marlin-pack-published.json: InvalidAccessKeyId; the "
                       r"credentials were refused"):
        open_remote(url)


def test_missing_object(published, s3) -> None:  # type: ignore[no-untyped-def]
    _, url = published
    s3.client().delete_object(Bucket=s3.bucket, Key="llama/tp2/rank-1.safetensors")
    bundle = open_remote(url)
    read_rank(plan_rank(bundle, 2, 0), lambda *a: None)  # rank 0 never needs rank 1's file
    with pytest.raises(BundleMismatchError, match=r"^s3://.*/llama/tp2/rank-1.safetensors is missing; publish it again "
                       r"with `marlin-pack push BUNDLE s3://.*/llama`"):
        plan_rank(bundle, 2, 1)


def test_truncated_object(published, s3) -> None:  # type: ignore[no-untyped-def]
    model, url = published
    data = (model / "marlin-pack" / "tp1/rank-0.safetensors").read_bytes()
    s3.client().put_object(Bucket=s3.bucket, Key="llama/tp1/rank-0.safetensors", Body=data[:-1000])
    with pytest.raises(BundleMismatchError, match=rf"tp1/rank-0.safetensors is {len(data) - 1000:,} bytes, the manifest says "
                       rf"{len(data):,}: truncated; publish it again"):
        plan_rank(open_remote(url), 1, 0)


def test_an_object_changed_after_the_plan(published, s3) -> None:  # type: ignore[no-untyped-def]
    model, url = published
    plan = plan_rank(open_remote(url), 1, 0)
    data = bytearray((model / "marlin-pack" / "tp1/rank-0.safetensors").read_bytes())
    data[-5] ^= 0xFF  # same size: only the block digests tell
    s3.client().put_object(Bucket=s3.bucket, Key="llama/tp1/rank-0.safetensors", Body=bytes(data))
    with pytest.raises(BundleMismatchError, match=r"tp1/rank-0.safetensors: block \d+ \(bytes [\d,]+\.\.[\d,]+\) does not match the "
                       r"publication record: the object changed since its manifest was read, or is damaged"):
        read_rank(plan, HostSink(plan))


def test_a_manifest_changed_between_read_and_use(published, make_bundle) -> None:  # type: ignore[no-untyped-def]
    _, url = published
    plan = plan_rank(open_remote(url), 1, 0)
    other = make_bundle("awq", group_size=32, tp_sizes=(1, 2), seed=1)  # same shapes, other bytes
    push(other / "marlin-pack", url, force=True, block_size=BLOCK)
    with pytest.raises(BundleMismatchError, match=r"(does not match the publication record|marlin-pack-published.json changed "
                       r"while the bundle was read)"):
        read_rank(plan, HostSink(plan))


def test_manifest_replaced_under_its_record(published, s3, make_bundle) -> None:  # type: ignore[no-untyped-def]
    _, url = published
    other = make_bundle("gptq", group_size=32)
    s3.client().put_object(Bucket=s3.bucket, Key=f"llama/{MANIFEST_NAME}", Body=(other / "marlin-pack" / MANIFEST_NAME).read_bytes())
    with pytest.raises(BundleError, match=r"manifest.json is not the manifest its publication record names \(SHA-256 "):
        open_remote(url)


def test_half_published(published, s3) -> None:  # type: ignore[no-untyped-def]
    _, url = published
    s3.client().delete_object(Bucket=s3.bucket, Key=f"llama/{RECORD_NAME}")  # as an interrupted push leaves it
    with pytest.raises(BundleError, match=r"^s3://.*/llama is half-published: it holds manifest.json but no "
                       r"marlin-pack-published.json \(a push was interrupted"):
        open_remote(url)
    with pytest.raises(BundleError, match=r"^no bundle at s3://.*/nothing: expected marlin-pack-published.json there; publish "
                       r"one with `marlin-pack push BUNDLE s3://.*/nothing`"):
        open_remote(url.replace("llama", "nothing"))


def test_tp_size_not_in_the_bundle(published) -> None:  # type: ignore[no-untyped-def]
    _, url = published
    with pytest.raises(BundleMismatchError, match=r"^bundle s3://.*/llama has tp 1, 2, not 4; convert it with --tp 4"):
        plan_rank(open_remote(url), 4, 0)
