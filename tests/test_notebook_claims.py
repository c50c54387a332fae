"""No notebook states a measured timing as a literal in its prose.

A sentence such as "v1 wins for small batches" or "about 10 µs at any batch size" is true of one
run on one machine; written into a markdown cell it stays there when the figures above it change
(another GPU, another run, a CPU). Such sentences belong in the measuring cell's output, printed
from the numbers it measured. The check below reads the markdown around every cell that measures
time and flags what reads like a measured outcome:

* a number with a unit of time (``12 µs``, ``0.17 ms``, ``3 s``) or a spelled-out one
  ("tens of microseconds");
* a ratio (``20×``, ``1.5x``, "3 times faster");
* a comparison of speed ("faster", "slower", "wins", "falls behind", "pulls ahead", "speed-up");
* a trend of a time in one sentence ("the time grows ...", "its cost stays flat ...").

Markdown elsewhere (the mechanism, a paper's figure quoted as the paper's) is not measured here
and is left alone. The planted notebook below shows that each kind of claim is caught.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

# A code cell that times something: the library's timers and benchmarks, or a clock.
MEASURES = re.compile(r"\bbench\.|\btiming\.|do_bench|perf_counter|\bwall_us\(|\bgraph_us\(|\bqueued_us\(|"
                      r"kernel_times\(|calls_table\(|decode_table\(|slot_mapping_times\(|run_engine\(|"
                      r"run_transformers\(|time\.time\(")

_NUMBER = r"(?<![\w.])\d[\d,]*(?:\.\d+)?"
CLAIMS = {
    "a time": re.compile(_NUMBER + r"\s*(?:µs|us|ms|ns|s|sec|seconds?|milliseconds?|microseconds?|nanoseconds?)\b"
                         r"|\b(?:micro|milli|nano)seconds?\b", re.IGNORECASE),
    "a ratio": re.compile(_NUMBER + r"\s*[x×](?![\w])|\b\d+(?:\.\d+)?\s+times\s+(?:faster|slower|more|less|as)\b"
                          r"|\b(?:tens|hundreds|dozens)\s+of\s+times\b|\b\w+-fold\b", re.IGNORECASE),
    "a comparison of speed": re.compile(
        r"\b(?:faster|slower|quicker|speed-?ups?|slow-?downs?|outperforms?|wins?|beats?|falls?\s+behind|"
        r"pulls?\s+ahead|overtakes?)\b", re.IGNORECASE),
}
# One sentence naming a time and a trend of it.
_TIME_NOUN = re.compile(r"\b(?:time|cost|costs|latency|throughput|tok/s|wall clock)\b", re.IGNORECASE)
_TREND = re.compile(r"\b(?:grows?|grew|growing|rises?|rising|falls?|drops?|stays?\s+(?:flat|constant|the same)|"
                    r"flat|linearly|at a (?:low|high|fixed|constant) rate|follows?\s+the\s+number|doubles?|halves?)\b",
                    re.IGNORECASE)


def _prose(markdown: str) -> str:
    """The markdown's sentences without code: fenced blocks and `inline code` dropped."""
    text = re.sub(r"```.*?```", " ", markdown, flags=re.DOTALL)
    return re.sub(r"`[^`]*`", " ", text)


def claims_in(markdown: str) -> list[str]:
    """What in ``markdown`` reads like a measured timing outcome, as ``"kind: text"`` strings."""
    text = _prose(markdown)
    found = [f"{kind}: {m.group(0)!r}" for kind, rx in CLAIMS.items() for m in rx.finditer(text)]
    for sentence in re.split(r"(?<=[.!?:;])\s+|\n\s*\n", text):
        if _TIME_NOUN.search(sentence) and _TREND.search(sentence):
            found.append(f"a trend of a time: {' '.join(sentence.split())!r}")
    return found


def measured_prose(nb) -> list[tuple[str, str]]:
    """``(cell id, markdown)`` of every markdown cell next to a measuring cell: the markdown just
    before it (back to the previous code cell) and just after it (up to the next code cell)."""
    cells, near = nb.cells, {}
    for i, cell in enumerate(cells):
        if cell.cell_type != "code" or not MEASURES.search(cell.source):
            continue
        for step in (-1, 1):
            j = i + step
            while 0 <= j < len(cells) and cells[j].cell_type == "markdown":
                near[j] = cells[j]
                j += step
    return [(cells[j].get("id", str(j)), cells[j].source) for j in sorted(near)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_no_markdown_states_a_measured_timing(path):
    nb = nbformat.read(path, as_version=4)
    problems = [f"{cell_id}: {claim}" for cell_id, md in measured_prose(nb) for claim in claims_in(md)]
    assert not problems, (f"{path.name}: prose next to a measuring cell states a measured outcome; print it "
                          "from the cell's own numbers instead:\n  " + "\n  ".join(problems))


def test_the_check_finds_planted_claims():
    md = nbformat.v4.new_markdown_cell
    code = nbformat.v4.new_code_cell
    planted = nbformat.v4.new_notebook(cells=[
        md("## 7. Measure\n\nWe time `ours` against vLLM's kernel (`1.5x` in code is not prose)."),
        code("times = bench.kernel_times()"),
        md("Ours takes about 10 µs at any batch size."),
        md("The loop costs tens of microseconds more."),
        md("v2 is 20× ahead here, and 3 times faster than v1 at 1024 requests."),
        md("On the wall clock, v1 wins for small batches."),
        md("So its time grows at a low, fixed rate."),
        code("x = 1"),
        md("Far from any measurement: ours is faster, in 10 µs."),
    ])
    found = [(cell_id, claim) for cell_id, text in measured_prose(planted) for claim in claims_in(text)]
    kinds = [claim.split(":")[0] for _, claim in found]
    assert kinds.count("a time") == 2 and kinds.count("a ratio") == 2
    assert kinds.count("a comparison of speed") == 2          # "wins" and "faster" (3 times faster)
    assert kinds.count("a trend of a time") == 1
    # The method paragraph before the measurement names no outcome; the cell after the next
    # code cell is not next to a measurement.
    assert not claims_in(planted.cells[0].source)
    assert all("Far from" not in text for _, text in measured_prose(planted))
    # The notebooks' own wording of a mechanism passes.
    assert not claims_in("Each CUDA block walks its whole context alone with four warps, and the "
                         "grid has one block per (head, sequence).")
