"""``bench/launches.py``: launches outside graph replays by kind, on the CPU's static-buffer path."""

from __future__ import annotations

import pytest

from ppcompile.cli import bench as bench_cli

launches = bench_cli._bench("launches")


@pytest.mark.usefixtures("fresh_dynamo")
def test_copies_count_two_ops_per_tensor_and_none_after_an_out_variant_break() -> None:
    rows = {r["attention"]: r for r in launches.run_launches("cpu", [("emulate", "torch")])}
    functional, out_variant = rows["functional"], rows["out-variant"]
    for row in rows.values():  # a copy_ and a zero_ per live input (positions, hidden states, residual)
        assert row["live_inputs"] == 3 and row["copy-in"] == 2 * 3
        assert row["breaks"] == 3 and row["break ops"] > 0
    assert functional["bridges"] == 3 and functional["bridge copies"] == 2 * 3
    assert out_variant["bridges"] == 0 and out_variant["bridge copies"] == 0
    assert "| functional | emulate | torch |" in launches.markdown(list(rows.values()), "cpu")
