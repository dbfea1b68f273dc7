"""``gs://bucket/prefix`` read the default way, with application-default credentials: Google's client
(``google-cloud-storage``) for the record, manifest, headers and ``push``, Run:ai's GCS backend for the ranges, both at
``gcp-storage-emulator`` on loopback (``conftest.gcs_adc``). Published, planned and streamed byte for byte as in S3, the
``marlin_prepacked`` loader's placed tensors those of a local load, and each refusal one line. ``MARLIN_PACK_GCS_HMAC=1``
(the XML API with an HMAC key) is ``test_gcs.py``'s.

Run:ai's streamer (0.17.1) keeps the first object-storage backend a process streams with (S3 or GCS): after an s3://
read in the same process, a gs:// read fails ("File access error"), and the reverse. So this module runs in a pytest
process of its own, started by ``test_gcs_adc_process.py``; collected beside the other tests, it is skipped.
"""

from __future__ import annotations

import os

import pytest
import torch
from remote_published import BLOCK, assert_rank_streams_its_files, publish_llama, same_bytes

from marlin_pack.errors import BundleMismatchError, MarlinPackError
from marlin_pack.remote import store
from marlin_pack.remote.bundle import open_remote, plan_rank
from marlin_pack.remote.push import push
from marlin_pack.remote.record import RECORD_NAME
from marlin_pack.remote.store import GcsStore, RemoteError, S3Store, open_store
from marlin_pack.remote.stream import HostSink, read_rank
from marlin_pack.remote.url import parse_url

ALONE = "MARLIN_PACK_TEST_GCS_ALONE"
pytestmark = pytest.mark.skipif(os.environ.get(ALONE) != "1", reason="run in a process of its own by test_gcs_adc_process.py")


@pytest.fixture
def published(make_bundle, gcs_adc):  # type: ignore[no-untyped-def]
    return publish_llama(make_bundle, gcs_adc)


def _read(url: str, tp: int = 1, rank: int = 0) -> None:
    plan = plan_rank(open_remote(url), tp, rank)
    read_rank(plan, HostSink(plan))


def test_push_then_read_every_rank_byte_exact(published, gcs_adc) -> None:  # type: ignore[no-untyped-def]
    model, url = published
    assert set(gcs_adc.keys("llama/")) == {f"llama/{p}" for p in ("manifest.json", "common.safetensors", RECORD_NAME,
                                                                  "tp1/rank-0.safetensors", "tp2/rank-0.safetensors",
                                                                  "tp2/rank-1.safetensors")}
    again = push(model / "marlin-pack", url, block_size=BLOCK)  # metadata read back: a second push writes nothing
    assert again.up_to_date and again.summary().startswith(f"{url} already holds this bundle")
    bundle = open_remote(url)
    assert isinstance(bundle.store, GcsStore)
    # Run:ai's streamer is handed the gs:// name itself (its GCS backend), with no endpoint of S3's
    assert bundle.store.stream_target("tp1/rank-0.safetensors") == (f"{url}/tp1/rank-0.safetensors", None)
    for tp, rank in ((1, 0), (2, 0), (2, 1)):
        assert_rank_streams_its_files(bundle, model, url, tp, rank)


def test_ranges_are_byte_exact(published) -> None:  # type: ignore[no-untyped-def]
    model, url = published
    data = (model / "marlin-pack/tp1/rank-0.safetensors").read_bytes()
    s = open_remote(url).store
    for start, length in ((0, 1), (5, 1000), (len(data) - 17, 17), (BLOCK - 3, 7)):
        assert s.get_range("tp1/rank-0.safetensors", start, length)[0] == data[start:start + length]
    with pytest.raises(RemoteError, match=rf"^{url}/tp1/rank-0.safetensors gave 10 bytes at offset {len(data) - 10:,}, expected 20"):
        s.get_range("tp1/rank-0.safetensors", len(data) - 10, 20)


def test_check_and_push_commands_take_gs(published, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from test_remote_check import _check

    model, url = published
    code, out, _ = _check(monkeypatch, capsys, str(model), "--bundle", url, "-tp", "2", "--compute-capability", "8.0")
    assert code == 0 and out.count(f"from {url}") == 2, out


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
def test_the_loader_places_what_a_local_load_places(published, monkeypatch: pytest.MonkeyPatch, streamed,  # type: ignore[no-untyped-def]
                                                    tp: int, rank: int) -> None:
    """``{"bundle": "gs://..."}`` with application-default credentials: the ``marlin_prepacked`` loader, as
    ``test_remote_loader``'s s3:// case, places every quantized parameter byte for byte as the local load of the same
    bundle, stock vLLM's post-processing's values, the rank's own files streamed through Run:ai's GCS backend."""
    import test_remote_loader as loader_tests

    model, url = published
    with loader_tests.stock_vllm_no_preload(monkeypatch):
        local = loader_tests._placed(model, monkeypatch, tp, rank)
        remote = loader_tests._placed(model, monkeypatch, tp, rank, bundle=url)
    assert remote.keys() == local.keys() and remote.pop("__common__") == local.pop("__common__")
    for name, want in local.items():
        got = remote[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert same_bytes(got, want), name
    reference = loader_tests.vr.reference_rank_tensors(model, tp, rank, torch.float16)
    assert reference and all(torch.equal(remote[n], t) for n, t in reference.items())  # stock vLLM's post-processing
    [(plan, done)] = streamed  # the local load streamed nothing
    assert str(plan.bundle.url) == url and isinstance(plan.bundle.store, GcsStore)  # not the HMAC (S3) path
    assert set(done.bytes_read) == {f"tp{tp}/rank-{rank}.safetensors", "common.safetensors"}  # never another rank's file
    for path, n in done.bytes_read.items():
        assert n == (model / "marlin-pack" / path).stat().st_size, path  # a whole rank: its files once each


def test_the_one_rule_hmac_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(store.GCS_HMAC_ENV, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "GOOG1EXAMPLE")  # an HMAC key in the environment is not enough
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    assert isinstance(open_store(parse_url("gs://bucket-1/x")), GcsStore)
    monkeypatch.setenv(store.GCS_HMAC_ENV, "1")
    assert isinstance(open_store(parse_url("gs://bucket-1/x")), S3Store)
    assert isinstance(open_store(parse_url("s3://bucket-1/x")), S3Store)


CASES = ["no credentials", "emulator named once", "bucket missing", "object missing", "truncated", "changed block",
         "re-published during the read", "record gone"]


@pytest.mark.parametrize("case", CASES)
def test_each_refusal_is_one_line(published, gcs_adc, monkeypatch: pytest.MonkeyPatch, tmp_path, case: str) -> None:  # type: ignore[no-untyped-def]
    model, url = published
    rank_key = "llama/tp1/rank-0.safetensors"
    data = (model / "marlin-pack/tp1/rank-0.safetensors").read_bytes()
    if case == "no credentials":  # no emulator: GCS itself, and no application-default credentials anywhere
        for var in ("STORAGE_EMULATOR_HOST", "CLOUD_STORAGE_EMULATOR_ENDPOINT"):
            monkeypatch.delenv(var)
        monkeypatch.setenv("NO_GCE_CHECK", "True")  # google-auth: do not ask a metadata server
        match = (rf"^cannot read {url}/{RECORD_NAME}: no credentials; set application-default credentials \(GKE workload "
                 r"identity, GOOGLE_APPLICATION_CREDENTIALS=KEY.json, .*\), or MARLIN_PACK_GCS_HMAC=1 with an HMAC key")
    elif case == "emulator named once":
        monkeypatch.delenv("CLOUD_STORAGE_EMULATOR_ENDPOINT")
        match = r"^STORAGE_EMULATOR_HOST=http://127.0.0.1:\d+ but CLOUD_STORAGE_EMULATOR_ENDPOINT=\(unset\): .*set both"
    elif case == "bucket missing":
        url = f"gs://{gcs_adc.bucket}-gone/llama"
        match = rf"^cannot read {url}/{RECORD_NAME}: NoSuchBucket; check the bucket's name"
    elif case == "object missing":
        gcs_adc.delete(rank_key)
        match = rf"^{url}/tp1/rank-0.safetensors is missing; publish it again with `marlin-pack push BUNDLE {url}`"
    elif case == "truncated":
        gcs_adc.put(rank_key, data[:-1])
        match = rf"^{url}/tp1/rank-0.safetensors is {len(data) - 1:,} bytes, the manifest says {len(data):,}: truncated"
    elif case == "changed block":  # replaced after the plan read its headers, size kept
        plan = plan_rank(open_remote(url), 1, 0)
        changed = bytearray(data)
        changed[len(changed) // 2] ^= 1
        gcs_adc.put(rank_key, bytes(changed))
        with pytest.raises(BundleMismatchError, match=rf"^{url}/tp1/rank-0.safetensors: block \d+ \(bytes [\d,]+\.\.[\d,]+\) "
                           "does not match the publication record") as e:
            read_rank(plan, HostSink(plan))
        assert "\n" not in str(e.value)
        return
    elif case == "re-published during the read":  # the record rewritten between the plan and the end of the read
        plan = plan_rank(open_remote(url), 1, 0)
        record = gcs_adc.client().blob(f"llama/{RECORD_NAME}").download_as_bytes()
        gcs_adc.put(f"llama/{RECORD_NAME}", record)  # same bytes, a new generation
        with pytest.raises(BundleMismatchError, match=rf"^{url}/{RECORD_NAME} changed while the bundle was read") as e:
            read_rank(plan, HostSink(plan))
        assert "\n" not in str(e.value)
        return
    else:
        gcs_adc.delete(f"llama/{RECORD_NAME}")
        match = rf"^{url} is half-published: it holds manifest.json but no {RECORD_NAME}"
    with pytest.raises(MarlinPackError, match=match) as e:
        _read(url)
    assert "\n" not in str(e.value)


def test_streamed_object_gone_is_one_line(published, gcs_adc) -> None:  # type: ignore[no-untyped-def]
    """An object deleted after the plan: Run:ai's GCS backend fails the read, said in one line with what to do."""
    _, url = published
    plan = plan_rank(open_remote(url), 1, 0)
    gcs_adc.delete("llama/tp1/rank-0.safetensors")
    with pytest.raises(RemoteError, match=rf"^reading {url} failed: .*; check the credentials and that the bundle is still "
                       "published there") as e:
        read_rank(plan, HostSink(plan))
    assert "\n" not in str(e.value)


def test_no_gcs_backend_is_one_line(published, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import importlib.util

    _, url = published
    plan = plan_rank(open_remote(url), 1, 0)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "runai_model_streamer_gcs" else find_spec(name, *a))
    with pytest.raises(RemoteError, match=r"^streaming gs:// needs Run:ai's GCS backend .*pip install 'marlin-pack\[gcs\]'"):
        read_rank(plan, HostSink(plan))


def test_a_file_over_8_mib_goes_up_resumable_and_whole(gcs_adc, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Google's client uploads a file larger than 8 MiB in a resumable session (rank files are GBs): the object the
    emulator then holds is the file, byte for byte, with its metadata; the progress counts every byte once."""
    size = (20 << 20) + 12_345  # not a multiple of any part size
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3)).numpy().tobytes()
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    s = open_store(parse_url(gcs_adc.url("big")))
    counted: list[int] = []
    with path.open("rb") as f:
        s.put_file("rank.safetensors", f, {"marlin-pack-sha256": "x"}, counted.append)
    info = s.head("rank.safetensors")
    assert info is not None and info.size == size and info.metadata == {"marlin-pack-sha256": "x"}
    assert sum(counted) == size
    for start, length in ((0, 4096), ((8 << 20) - 5, 10), (size - 777, 777)):
        assert s.get_range("rank.safetensors", start, length)[0] == data[start:start + length]
