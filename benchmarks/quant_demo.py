"""Folded into benchmarks/quant.py: `quant_demo.py ARGS` is `quant.py speed ARGS` (same flags, same JSON rows).

The name stays only because benchmarks/fp8_demo.py (another stream's file this session) runs it;
delete this file when that script runs `quant.py speed`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.quant import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["speed", *sys.argv[1:]]))
