"""``load_timings``: the words of the loader's timings line."""

from __future__ import annotations

from marlin_pack.vllm_plugin.load_timings import LoadTimings


def test_the_timings_line_says_when_the_helpers_were_ready_and_what_they_page_locked_ahead() -> None:
    t = LoadTimings(copy=1.0, copy_bytes=40_000_000_000, helpers_ready=0.02, helpers_retained=39_500_000_000)
    assert t.copy_text() == "read+copy 1.00 s (40.00 GB, 40.0 GB/s), helpers ready after 0.02 s, 39.50 GB page-locked ahead"
    t.helpers_retained = 3_400_000  # a test's bundle
    assert t.copy_text().endswith("helpers ready after 0.02 s, 3.4 MB page-locked ahead")
    for nothing in (None, 0):  # no preload, or nothing page-locked
        t.helpers_retained = nothing
        assert t.copy_text().endswith("helpers ready after 0.02 s")
    t.helpers_ready = None  # no helpers
    assert t.copy_text() == "read+copy 1.00 s (40.00 GB, 40.0 GB/s)"
    t.beside, t.wait = True, 0.25
    assert t.copy_text() == "read+copy 1.00 s (40.00 GB, 40.0 GB/s) beside create and common, waited 0.25 s"
