"""``test_gcs_adc.py`` in a pytest process of its own: Run:ai's streamer (0.17.1) keeps the first object-storage backend
a process streams with, so gs:// through its GCS backend cannot share a process with the s3:// tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_gcs_with_application_default_credentials(tmp_path: Path) -> None:
    for module, why in (("gcp_storage_emulator.server", "gcp-storage-emulator (the test extra) serves GCS's JSON API"),
                        ("google.cloud.storage", "google-cloud-storage (the gcs extra) reads gs:// with ADC"),
                        ("runai_model_streamer_gcs", "runai-model-streamer[gcs] (the gcs extra) streams gs:// with ADC")):
        pytest.importorskip(module, reason=why)
    here = Path(__file__).parent
    env = {**os.environ, "MARLIN_PACK_TEST_GCS_ALONE": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'gcs'}",
                          str(here / "test_gcs_adc.py")], cwd=here.parent.parent, env=env, capture_output=True, text=True, timeout=600)
    last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and " passed" in last and "skipped" not in last, run.stdout[-4000:] + run.stderr[-2000:]
