"""Run the torchtitan matrix against whichever ``spmd_types`` is importable and print a table.

Not a test module (pytest collects ``test_*.py`` only). With the peer package::

    cd /tmp && PYTHONPATH=/work/peer/site:/work/wt/titan python /work/wt/titan/tests/torchtitan_peer_check.py

Rows: each case on the fake group (checking on: type-only, rank 0's program),
on simulated ranks against the same run with checking off (every rank's own
loss and gradients), and against the same model on one device (loss and
gradients reassembled from the declared layouts); then each planted mistake
(expected: ``SpmdTypeError``, pointing at the torchtitan lines listed).
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _torchtitan_mistakes as tm  # noqa: E402
import _torchtitan_support as tt  # noqa: E402


def _case_rows(c: tt.Case) -> list[tuple[str, str, str, str]]:
    rows = []
    try:
        tt.run(c, "fake")
        rows.append((c.name, "fake group", "ok", "-"))
    except Exception as exc:  # a table row says what broke; the run goes on
        rows.append((c.name, "fake group", f"error: {_first_line(exc)}", "-"))
    try:
        on = tt.run(c, "local", checking=True, one_device=True)
        off = tt.run(c, "local", checking=False)
        on_off = max([tt.max_abs_diff(on.loss, off.loss)] + [tt.max_abs_diff(on.grads[n], off.grads[n]) for n in on.grads])
        rows.append((c.name, "simulated: on vs off", "ok", f"{on_off:.3g}"))
        ref = tt.run_one_device(c, {n: v[0] for n, v in on.global_weights.items()})
        loss = tt.max_abs_diff(on.global_loss, ref.loss[0])
        grad = max(tt.max_abs_diff(on.global_grads[n], ref.grads[n][0]) for n in ref.grads)
        scale = max(float(g[0].abs().max()) for g in ref.grads.values())
        rows.append((c.name, "simulated: vs one device", "ok",
                     f"loss {loss:.3g}, grad {grad:.3g} (max |grad| {scale:.3g})"))
    except Exception as exc:  # as above
        rows.append((c.name, "simulated", f"error: {_first_line(exc)}", "-"))
    return rows


def _mistake_row(m: tm.Mistake) -> tuple[str, str, str, str]:
    import spmd_types as spmd

    try:
        exc = tm.plant(m)
    except AssertionError as ran_through:
        return (m.name, m.case, "NOT CAUGHT", str(ran_through))
    frames = tm.torchtitan_frames(exc)
    kind = "SpmdTypeError" if isinstance(exc, spmd.SpmdTypeError) else type(exc).__name__
    points = all(line in frames or line in str(exc) for line in m.lines)
    where = " <- ".join(reversed(frames[-2:]))
    return (m.name, m.case, f"{kind}{'' if points else ' (elsewhere)'}", f"{_first_line(exc)} @ {where}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:160]


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "| " + " | ".join(str(v).ljust(w) for v, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main() -> None:
    import spmd_types

    tt.load()
    print(f"spmd_types from {os.path.dirname(spmd_types.__file__)}")
    start = time.time()
    rows = [row for c in tt.CASES for row in _case_rows(c)]
    print(_table(("model / config", "environment", "result", "max abs error"), rows))
    print()
    print(_table(("planted mistake", "case", "raised", "first line @ torchtitan lines"), [_mistake_row(m) for m in tm.MISTAKES]))
    print(f"\n{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
