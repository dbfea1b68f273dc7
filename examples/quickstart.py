"""Quick start on an embedded example: write a tiny AutoAWQ checkpoint, convert it, verify it.

    python examples/quickstart.py [WORKDIR]        # default WORKDIR: .example
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

from marlin_pack.testing.synthetic import PRESETS, write_awq_checkpoint

work = Path(sys.argv[1] if len(sys.argv) > 1 else ".example")
# A tokenizer (for `vllm serve`) needs the `tokenizers` package, which vLLM brings along.
has_tokenizers = importlib.util.find_spec("tokenizers") is not None
model = write_awq_checkpoint(work / "tiny-awq", PRESETS["tiny"], group_size=128, tokenizer=has_tokenizers)
print(f"wrote tiny AWQ checkpoint: {model}")
cli = [sys.executable, "-m", "marlin_pack.cli"]
subprocess.run([*cli, "convert", str(model), "--tp", "1,2", "--force"], check=True)
subprocess.run([*cli, "verify", str(model / "marlin-pack")], check=True)
print(f"serve it with: vllm serve {model} --load-format marlin_prepacked")
