"""Draw the SVG pictures in docs/img/ from the transition table, so they cannot drift from the code.

Run: python docs/diagrams.py            (writes docs/img/*.svg)
     python docs/diagrams.py --check    (exit 1 if a picture is missing, stale or extra)

One picture per row of ``spmd_types._local.transitions.TRANSITIONS``: three ranks as
rows, the forward on the left and its backward (the op the row names) on the
right, in seed 003's notation (``+A`` is one term of a pending sum, ``[A, B]``
a value laid out on a dim). The per-rank values are the ones docs/collectives.md
shows (``_DIAGRAMS`` in docs/generate.py); a row without them stops this script.
Two more pictures, for the concepts page: what R, I, V, P and S(d) denote, and
the duality between a type and its gradient's type.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from html import escape

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from generate import _DIAGRAMS  # noqa: E402  (the per-rank values docs/collectives.md shows)

from spmd_types._local.transitions import TRANSITIONS  # noqa: E402

IMG = HERE / "img"
FILL = {"R": "#dbeafe", "I": "#dcfce7", "V": "#fef3c7", "P": "#fce7f3"}
STROKE = {"R": "#1d4ed8", "I": "#15803d", "V": "#b45309", "P": "#be185d"}
FONT = 'font-family="ui-monospace, Menlo, Consolas, monospace"'
RANKS = 3
ROW_H, TOP, LEFT = 34, 72, 62


def file_name(op: str, src, dst) -> str:
    """``all_gather_V_R.svg``: the picture of ``op(src -> dst)``."""
    return f"{op}_{src}_{dst}.svg"


def _svg(width: int, height: int, body: list[str], title: str) -> str:
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">'
    )
    return "\n".join([head, f"<title>{escape(title)}</title>", f'<rect width="{width}" height="{height}" fill="white"/>',
                      *body, "</svg>"]) + "\n"


def _text(x: float, y: float, s: str, *, size: int = 13, anchor: str = "middle", weight: str = "normal",
          color: str = "#111827") -> str:
    return (f'<text x="{x:g}" y="{y:g}" font-size="{size}" text-anchor="{anchor}" font-weight="{weight}" '
            f'fill="{color}" {FONT}>{escape(s)}</text>')


def _cells(values: list[str]) -> list[str]:
    """One entry per rank; a single entry is the same value on every rank."""
    return values if len(values) == RANKS else values * RANKS


def _column(x: float, width: float, values: list[str], t) -> list[str]:
    """A column of per-rank boxes of type ``t`` (a pending sum dashed), its type above it."""
    kind = str(t)
    dash = ' stroke-dasharray="5 3"' if kind == "P" else ""
    out = [_text(x + width / 2, TOP - 8, kind, size=14, weight="bold", color=STROKE[kind])]
    for r, value in enumerate(_cells(values)):
        y = TOP + r * ROW_H
        out.append(f'<rect x="{x:g}" y="{y:g}" width="{width:g}" height="{ROW_H - 8}" rx="4" '
                   f'fill="{FILL[kind]}" stroke="{STROKE[kind]}"{dash}/>')
        out.append(_text(x + width / 2, y + ROW_H / 2, value))
    return out


def _arrow(x0: float, x1: float, label: str) -> list[str]:
    """An arrow from x0 to x1 across the middle rank, labelled with what it communicates."""
    y = TOP + ROW_H + (ROW_H - 8) / 2
    head = 7 if x1 > x0 else -7
    return [
        f'<line x1="{x0:g}" y1="{y:g}" x2="{x1:g}" y2="{y:g}" stroke="#374151" stroke-width="1.5"/>',
        f'<path d="M{x1:g},{y:g} l{-head},-5 l0,10 z" fill="#374151"/>',
        _text((x0 + x1) / 2, y - 8, label, size=11, color="#374151"),
    ]


def _width(values: list[str]) -> float:
    return max(48.0, 8.0 * max(len(v) for v in values) + 16)


def transition_svg(t) -> str:
    """Forward ``t.op(src -> dst)`` beside its backward, ranks as rows."""
    key = (t.op, t.src, t.dst)
    if key not in _DIAGRAMS:
        raise KeyError(f"no per-rank values for {t.op}(src={t.src}, dst={t.dst}) in docs/generate.py _DIAGRAMS")
    fin, fout, gin, gout = _DIAGRAMS[key]
    bop, bsrc, bdst = t.backward
    wi, wo = _width(fin + gin), _width(fout + gout)
    back_label = f"backward: {bop}(src={bsrc}, dst={bdst})"
    panel = max(wi + 112 + wo, 7.5 * len(back_label) + 16)
    gap = panel - wi - wo
    body = [_text(LEFT + panel + 36, 20, f"{t.op}(x, axis, src={t.src}, dst={t.dst})", size=15, weight="bold"),
            _text(LEFT + panel / 2, 44, f"forward: {t.op}", size=12, color="#4b5563"),
            _text(LEFT + panel + 72 + panel / 2, 44, back_label, size=12, color="#4b5563")]
    for r in range(RANKS):
        body.append(_text(8, TOP + r * ROW_H + ROW_H / 2, f"rank {r}", size=11, anchor="start", color="#6b7280"))
    x = LEFT
    body += _column(x, wi, fin, t.src) + _arrow(x + wi + 8, x + wi + gap - 8, t.comm)
    body += _column(x + wi + gap, wo, fout, t.dst)
    x = LEFT + panel + 72
    body += _column(x, wi, gin, bdst) + _arrow(x + wi + gap - 8, x + wi + 8, _comm_of(bop))
    body += _column(x + wi + gap, wo, gout, bsrc)
    sep = LEFT + panel + 36
    body.append(f'<line x1="{sep:g}" y1="30" x2="{sep:g}" y2="{TOP + RANKS * ROW_H:g}" stroke="#d1d5db"/>')
    height = TOP + RANKS * ROW_H + 22
    body.append(_text(LEFT, height - 8, t.meaning, size=11, anchor="start", color="#4b5563"))
    return _svg(int(LEFT + 2 * panel + 72 + 12), int(height), body, f"{t.op}(src={t.src}, dst={t.dst})")


def _comm_of(op: str) -> str:
    return op if op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") else "none"


# What each type denotes: three ranks' local values, and the one value on a single device they mean.
_DENOTE = (
    ("R", ["a", "a", "a"], "a", "P", "the same on every rank"),
    ("I", ["a", "a", "a"], "a", "I", "the same; its gradient is already summed"),
    ("V", ["a", "b", "c"], "stack(a, b, c)", "V", "one value per rank"),
    ("S(0)", ["a", "b", "c"], "cat(a, b, c)", "S(0)", "V, laid out as shards of dim 0"),
    ("P", ["+a", "+b", "+c"], "a + b + c", "R", "a pending sum"),
)


def denotation_svg() -> str:
    """Rows: a type; columns: rank 0..2's local data, what it denotes, its gradient's type."""
    body = [_text(16, 22, "What a type means: three ranks' local data and the one value it denotes", size=14,
                  anchor="start", weight="bold")]
    heads = [(78, "rank 0"), (148, "rank 1"), (218, "rank 2"), (360, "denotes"), (500, "gradient")]
    body += [_text(x, 46, s, size=11, color="#6b7280") for x, s in heads]
    for i, (name, local, meaning, grad, note) in enumerate(_DENOTE):
        y = 58 + i * 40
        base = "V" if name.startswith("S") else name
        dash = ' stroke-dasharray="5 3"' if base == "P" else ""
        body.append(_text(20, y + 19, name, size=14, weight="bold", color=STROKE[base]))
        for r, v in enumerate(local):
            body.append(f'<rect x="{52 + 70 * r}" y="{y}" width="52" height="28" rx="4" fill="{FILL[base]}" '
                        f'stroke="{STROKE[base]}"{dash}/>')
            body.append(_text(78 + 70 * r, y + 19, v))
        body.append(_text(272, y + 19, "=>", color="#374151"))
        body.append(_text(360, y + 19, meaning))
        gbase = "V" if grad.startswith("S") else grad
        body.append(_text(500, y + 19, grad, size=14, weight="bold", color=STROKE[gbase]))
        body.append(_text(540, y + 19, note, size=11, anchor="start", color="#4b5563"))
    return _svg(880, 58 + len(_DENOTE) * 40 + 8, body, "R, I, V, P and S(d): local data and denotation")


def duality_svg() -> str:
    """The gradient's type of each type: R and P swap, I and V (and S(d)) map to themselves."""
    body = [_text(16, 22, "Duality: the type of the gradient", size=14, anchor="start", weight="bold")]
    spots = {"R": (80, 90), "P": (280, 90), "I": (420, 90), "V": (560, 90)}
    for name, (x, y) in spots.items():
        body.append(f'<circle cx="{x}" cy="{y}" r="24" fill="{FILL[name]}" stroke="{STROKE[name]}"/>')
        body.append(_text(x, y + 5, name, size=16, weight="bold", color=STROKE[name]))
    body += [
        '<path d="M106,80 Q180,50 254,80" fill="none" stroke="#374151" stroke-width="1.5"/>',
        '<path d="M254,80 l-9,-1 l5,-7 z" fill="#374151"/>',
        '<path d="M254,100 Q180,130 106,100" fill="none" stroke="#374151" stroke-width="1.5"/>',
        '<path d="M106,100 l9,1 l-5,7 z" fill="#374151"/>',
        _text(180, 52, "gradient of R is P", size=11, color="#4b5563"),
        _text(180, 140, "gradient of P is R", size=11, color="#4b5563"),
    ]
    for name in ("I", "V"):
        x, y = spots[name]
        body.append(f'<path d="M{x - 12},{y - 21} C{x - 30},{y - 62} {x + 30},{y - 62} {x + 12},{y - 21}" fill="none" '
                    f'stroke="#374151" stroke-width="1.5"/>')
        body.append(f'<path d="M{x + 12},{y - 21} l-1,-10 l7,4 z" fill="#374151"/>')
        body.append(_text(x, y + 44, f"gradient of {name} is {name}", size=11, color="#4b5563"))
    body.append(_text(16, 176, "S(d) is V laid out on dim d: its gradient is S(d). A parameter typed R on an axis gets "
                               "a P gradient (a pending sum) there.", size=11, anchor="start", color="#4b5563"))
    return _svg(780, 190, body, "duality of R, I, V, P")


def pictures() -> dict[str, str]:
    """``{file name: SVG text}`` for every picture this script draws."""
    out = {file_name(t.op, t.src, t.dst): transition_svg(t) for t in TRANSITIONS}
    out["denotation.svg"] = denotation_svg()
    out["duality.svg"] = duality_svg()
    assert len(out) == len(TRANSITIONS) + 2, "two transitions share a file name"
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    want = pictures()
    have = {p.name for p in IMG.glob("*.svg")} if IMG.exists() else set()
    if args.check:
        stale = [n for n, text in want.items() if not (IMG / n).exists() or (IMG / n).read_text() != text]
        extra = sorted(have - set(want))
        if stale or extra:
            print(f"docs/img is out of date: stale {sorted(stale)}, extra {extra}; run python docs/diagrams.py")
            return 1
        return 0
    IMG.mkdir(exist_ok=True)
    for name in have - set(want):
        (IMG / name).unlink()
    for name, text in want.items():
        (IMG / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
