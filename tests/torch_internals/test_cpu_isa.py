"""ppcompile.torch_internals.cpu_isa: a probe answer is adopted only where it holds, and then no ISA's own
probe runs.

Each check runs in a fresh process: Inductor memoises its probe answer for the process.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

_COUNTED = '''
import dataclasses, json, sys
from torch._inductor import config, cpu_vec_isa
from ppcompile.torch_internals.cpu_isa import ProbedVecIsas, adopt_vec_isas, probed_vec_isas

probes = []  # each ISA's own probe
features = []  # the AVX-512 family's probes of a feature (bf16, VNNI, AMX) once the ISA's own passed
build = cpu_vec_isa.VecISA.check_build
def counted(self, code):
    (probes if code == cpu_vec_isa.VecISA._avx_code else features).append(str(self))
    return build(self, code)
cpu_vec_isa.VecISA.check_build = counted
'''

_PROBE = _COUNTED + '''
before = probed_vec_isas()
picked = str(cpu_vec_isa.pick_vec_isa())
print(json.dumps({"before": before is None, "picked": picked, "probes": probes, "features": features,
                  "probed": dataclasses.asdict(probed_vec_isas())}))
'''

_ADOPT = _COUNTED + '''

stored = json.loads(sys.argv[1])
answer = ProbedVecIsas(stored["toolchain"], tuple(stored["isas"]))
with config.patch({"cpp.vec_isa_ok": True}):
    user_decides = adopt_vec_isas(answer)
other_toolchain = adopt_vec_isas(ProbedVecIsas(answer.toolchain + " another compiler", answer.isas))
other_isas = adopt_vec_isas(ProbedVecIsas(answer.toolchain, answer.isas + ("an ISA this CPU lacks",)))
still_unprobed = probed_vec_isas() is None
adopted = adopt_vec_isas(answer)
picked = str(cpu_vec_isa.pick_vec_isa())
print(json.dumps({"user_decides": user_decides, "other_toolchain": other_toolchain, "other_isas": other_isas,
                  "still_unprobed": still_unprobed, "adopted": adopted, "again": adopt_vec_isas(answer),
                  "picked": picked, "probes": probes, "features": features, "none": adopt_vec_isas(None)}))
'''


def _run(code: str, *args: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_a_fresh_process_adopts_a_probe_answer_that_holds_and_runs_no_probe() -> None:
    first = _run(_PROBE)
    assert first["before"]  # nothing probed yet: nothing to carry
    if platform.machine() in ("x86_64", "AMD64"):
        assert first["probes"]  # Inductor probes every ISA the CPU's flags name
    second = _run(_ADOPT, json.dumps(first["probed"]))
    # Refused where it may not hold: the user set the answer, another toolchain, other candidate ISAs.
    assert not second["user_decides"] and not second["other_toolchain"] and not second["other_isas"]
    assert second["still_unprobed"]  # a refusal leaves the probe to Inductor
    assert second["adopted"] and not second["again"] and not second["none"]
    assert second["picked"] == first["picked"]
    assert second["probes"] == []  # Inductor picked its ISA without probing it
    # An AVX-512 CPU's feature probes run as they did in the first process: they set the flags
    # kernels build with (adopting skips each ISA's own probe only).
    assert sorted(second["features"]) == sorted(first["features"])
