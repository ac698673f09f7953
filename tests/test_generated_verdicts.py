"""Every verdict word of the generated pages is what the committed CSVs give under the one rule: the claims index
(docs/results/claims.md), the retrieval study's comparisons and the owl study's tables. Regenerate a page that
fails with the command its docstring names."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest

from ropekit_studies.claims import render_claims
from ropekit_studies.verdict import WORDS

RESULTS = Path(__file__).resolve().parent.parent / "docs" / "results"


def _words(text: str):
    return re.findall(r"\*\*(" + "|".join(WORDS + ("trend against the claim",)) + r")\*\*", text)


def test_claims_page_matches_the_csvs():
    committed = (RESULTS / "claims.md").read_text()
    fresh = render_claims(RESULTS)
    assert _words(committed) == _words(fresh), "regenerate: python -m ropekit_studies.claims docs/results"
    assert committed == fresh, "regenerate: python -m ropekit_studies.claims docs/results"
    assert len(_words(fresh)) >= 4 * 17  # four classification folders of 17 claims each, and retrieval's
    native, finetune = fresh.split("## native-resolution", 1)[1].split("## resolution-finetune\n", 1)
    finetune, finetune4 = finetune.split("## resolution-finetune-4x\n", 1)
    assert len(_words(native)) == 9 + 8  # the papers' 9 claims and 4 methods x 2 trainings (from the study's CSV)
    assert len(_words(finetune)) == 3 * 5  # pi - none, yarn - none, yarn - pi for five encodings
    assert len(_words(finetune4)) == 3 * 4  # the same at 4x for four


def test_retrieval_table_matches_its_csv():
    from ropekit_studies.retrieval import ARMS, comparison_table, comparisons

    with open(RESULTS / "retrieval" / "retrieval.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    text = (RESULTS / "retrieval" / "table.md").read_text()
    fresh = comparison_table(comparisons(rows, arms))
    assert fresh in text
    assert _words(text) == _words(fresh) and len(_words(fresh)) == 12


def test_owl_table_matches_its_csv(tmp_path):
    from ropekit_studies.owl import write_report

    src = RESULTS / "owl"
    doc = json.loads((src / "config.json").read_text())

    def conv(v: str):
        try:
            return int(v) if v.isdigit() else float(v)
        except ValueError:
            return v

    with open(src / "owl.csv", newline="") as fh:
        rows = [{k: conv(v) for k, v in r.items() if v != ""} for r in csv.DictReader(fh)]
    if (src / "runs").is_dir():
        shutil.copytree(src / "runs", tmp_path / "runs")
    write_report(doc["recipe"], rows, tmp_path, preset=doc["preset"], argv=["owl"])
    committed, fresh = (src / "table.md").read_text(), (tmp_path / "table.md").read_text()
    words = re.compile(r"\| (holds|reversed|trend|null|not assessable|-) ")
    assert words.findall(committed) == words.findall(fresh)
    assert committed == fresh


@pytest.mark.sim
@pytest.mark.parametrize("folder", ["robot", "robot-ood"])
def test_robot_tables_match_their_csv(folder):
    pytest.importorskip("pybullet")
    from ropekit_studies.robot import _paired_lines, paired_verdicts

    src = RESULTS / folder
    doc = json.loads((src / "robot.json").read_text())
    agg = doc["summary"]["aggregate"]
    policies = list(dict.fromkeys(a["policy"] for a in agg))
    conditions = list(dict.fromkeys(a["condition"] for a in agg))
    with open(src / "robot.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    fresh = "\n".join(_paired_lines({(a["policy"], a["condition"]): a for a in agg}, policies, conditions,
                                    paired_verdicts(rows, policies, conditions)))
    text = (src / "table.md").read_text()
    assert fresh in text, f"regenerate the paired section of docs/results/{folder}/table.md"


def _write_retrieval_folder(folder: Path, study: str, rows):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"study": study, "preset": "default"}))
    with open(folder / f"{study}.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def _section(text: str, heading: str) -> str:
    part = text.split(f"\n## {heading}\n", 1)[1]
    return part.split("\n## ", 1)[0]


def test_a_dropped_in_retrieval_depth_folder_is_indexed_with_its_hard_negatives(tmp_path):
    """A ``retrieval-depth`` folder put under docs/results is read by the index with no code change: its recall
    claims, the power of RGB-D Cayley − RGB-D RoPE, and per arm the depth hard-negative accuracy against chance
    with the verdict of the one rule (the RGB control at chance reads null with its MDE; the RGB-D towers far above
    it hold); too few pairs read "not assessable", and runs without the measure say so."""
    from ropekit_studies.verdict import seeds_needed

    pairs = 400
    acc = {"rgb-ape": [0.5, 0.5, 0.5], "rgb-cayley": [0.49, 0.51, 0.5], "rgbd-rope": [0.66, 0.70, 0.68],
           "rgbd-cayley": [0.70, 0.74, 0.72]}
    recall = {"rgb-ape": [0.10, 0.12, 0.11], "rgb-cayley": [0.11, 0.12, 0.10], "rgbd-rope": [0.15, 0.20, 0.16],
              "rgbd-cayley": [0.17, 0.24, 0.19]}
    rows = [{"arm": a, "seed": k, "mean_recall": recall[a][k], "depth_hn_acc": acc[a][k],
             "depth_hn_pairs": pairs, "depth_hn_ties": 0} for a in acc for k in range(3)]
    _write_retrieval_folder(tmp_path / "retrieval-depth", "retrieval-depth", rows)
    text = render_claims(tmp_path)
    sec = _section(text, "retrieval-depth")
    assert "`ropekit experiment retrieval-depth`" in sec and "depth-only" in sec
    hn = {line.split(" | ")[0].lstrip("| "): line for line in sec.splitlines() if line.startswith("| RGB")
          and "chance" in line}
    assert set(hn) == {"RGB, APE (baseline)", "RGB, Cayley-STRING (2-D)", "RGB-D, RoPE (axial), depth as z",
                       "RGB-D, Cayley-STRING, depth as z"}
    # the control at exactly 0.5 on 3 x 400 captions: null, with the MDE of the captions' binomial spread,
    # (z_0.975 + z_0.8) sqrt(0.25 / 1200) = 4.04 points (the bootstrap's quantiles: a few per cent of Monte Carlo)
    assert "**null** (MDE " in hn["RGB, APE (baseline)"] and "yes (expected null)" in hn["RGB, APE (baseline)"]
    mde = float(re.search(r"MDE ([0-9.]+)", hn["RGB, APE (baseline)"]).group(1))
    assert mde == pytest.approx(100 * 2.8016 * (0.25 / 1200) ** 0.5, rel=0.08)
    assert "**null**" in hn["RGB, Cayley-STRING (2-D)"]
    # 0.68 and 0.72 over 1,200 captions each: z > 12 from chance, far beyond any Holm threshold
    for arm in ("RGB-D, RoPE (axial), depth as z", "RGB-D, Cayley-STRING, depth as z"):
        assert "**holds**" in hn[arm] and "yes (expected holds)" in hn[arm] and "| 1200 |" in hn[arm]
    # the STRING-against-RoPE pair and its power: sd of (+0.02, +0.04, +0.03) = 0.01
    assert "RGB-D, depth as z: Cayley-STRING − RoPE (axial) | 3 | +3.00 ± 1.00 |" in sec
    assert f"needs about {seeds_needed(0.01, 0.01)} seeds" in sec and seeds_needed(0.01, 0.01) == 8

    # an RGB control above chance is flagged; one seed or too few pairs are not assessable; no measure, said so
    leak = [dict(r, depth_hn_acc=0.75) if r["arm"] == "rgb-ape" else r for r in rows]
    shutil.rmtree(tmp_path / "retrieval-depth")
    _write_retrieval_folder(tmp_path / "retrieval-depth", "retrieval-depth", leak)
    line = next(x for x in _section(render_claims(tmp_path), "retrieval-depth").splitlines()
                if x.startswith("| RGB, APE (baseline) | control"))
    assert "**holds**" in line and "**no** (expected null)" in line
    one = [r for r in rows if r["seed"] == 0]
    _write_retrieval_folder(tmp_path / "one" / "retrieval-depth", "retrieval-depth", one)
    sec = _section(render_claims(tmp_path / "one"), "retrieval-depth")
    assert sec.count("**not assessable**") == 4 + 5  # four arms, the five recall claims among them, one seed
    bare = [{k: v for k, v in r.items() if not k.startswith("depth_hn")} for r in rows]
    _write_retrieval_folder(tmp_path / "bare" / "retrieval", "retrieval", bare)
    assert "Depth hard negatives: not measured" in _section(render_claims(tmp_path / "bare"), "retrieval")


def test_the_index_reads_the_committed_depth_only_smoke_run():
    """docs/results/retrieval-depth-quick (2 pairs per arm in all) is indexed: every hard-negative claim is not
    assessable, as its README says."""
    sec = _section((RESULTS / "claims.md").read_text(), "retrieval-depth-quick")
    rows = [x for x in sec.splitlines() if "chance" in x and x.startswith("| RGB")]
    assert len(rows) == 3 and all("**not assessable**" in x and "| 2 |" in x for x in rows)


class _V:
    """A verdict's fields as the pages write them (3 decimals, a real minus sign)."""

    def __init__(self, v):
        self.word, self.label = v.word, v.label
        self.lo, self.hi = self._signed(v.low95), self._signed(v.high95)
        self.mde, self.ph = f"{v.mde:.3f}", f"{v.p_holm:.3f}"

    @staticmethod
    def _signed(x: float) -> str:
        return f"{x:+.3f}".replace("-", "−")


def _acc(path: Path, *keys: str):
    """``{(key values..., seed): test_acc}`` of a study CSV."""
    with open(path, newline="") as fh:
        return {tuple(r[k] for k in keys) + (int(r["seed"]),): float(r["test_acc"]) for r in csv.DictReader(fh)}


def _family(diffs):
    from ropekit_studies.verdict import judge

    return {k: _V(v) for k, v in judge(diffs, {k: 1 for k in diffs}).items()}


def _flat(page: str) -> str:
    return " ".join((RESULTS / page).read_text().split())


def test_hand_written_readings_of_the_study_readmes_match_the_csvs():
    """The verdict words (and intervals, MDEs, Holm p) that study READMEs state in prose are what the one rule gives
    on the committed CSVs, each family as the page names it."""
    from ropekit_studies.verdict import judge_one

    seeds = range(3)
    # scale-width: the six LieRE comparisons one family; the growth 32 -> 128 read alone
    a = _acc(RESULTS / "scale-width" / "scale-width.csv", "pe", "width")
    fam = {f"{ref}{w}": [a[("liere", str(w), s)] - a[(pe, str(w), s)] for s in seeds]
           for ref, pe in (("a", "absolute"), ("m", "mixed")) for w in (32, 64, 128)}
    v = _family(fam)
    assert v["a32"].word == v["a64"].word and v["m64"].word == v["m128"].word
    g = _V(judge_one([fam["a128"][s] - fam["a32"][s] for s in seeds]))
    page = _flat("scale-width/README.md")
    for text in (f"LieRE − APE is a **{v['a32'].word}** at 32 and 64 (95 % [{v['a32'].lo}, {v['a32'].hi}] and "
                 f"[{v['a64'].lo}, {v['a64'].hi}]; MDE {v['a32'].mde} and {v['a64'].mde}) and a "
                 f"**{v['a128'].word}** at 128 (95 % [{v['a128'].lo}, {v['a128'].hi}]",
                 f"LieRE − RoPE-Mixed is a **{v['m32'].word}** at 32 (95 % [{v['m32'].lo}, {v['m32'].hi}]) and a "
                 f"**{v['m64'].word}** at 64 and 128 (MDE {v['m64'].mde} and {v['m128'].mde})",
                 f"(−0.018/+0.077/+0.068): a **{g.word}** (95 % [{g.lo}, {g.hi}], MDE {g.mde};"):
        assert text in page, text
    # data-efficiency-depth6-liere: its five LieRE comparisons at equal steps one family
    st = _acc(RESULTS / "data-efficiency-depth6-liere" / "equal-steps.csv", "pe", "fraction")
    mx = _acc(RESULTS / "data-efficiency-depth6" / "equal-steps.csv", "pe", "fraction")
    lead = {f: [st[("liere", f, s)] - st[("absolute", f, s)] for s in seeds] for f in ("0.1", "0.25", "0.5", "1")}
    v = _family({"a10": lead["0.1"], "a25": lead["0.25"], "a50": lead["0.5"],
                 "g": [lead["0.1"][s] - lead["1"][s] for s in seeds],
                 "m10": [st[("liere", "0.1", s)] - mx[("mixed", "0.1", s)] for s in seeds]})
    text = (f"LieRE − APE on 10 % **{v['a10'].word}** (95 % [{v['a10'].lo}, {v['a10'].hi}], Holm p {v['a10'].ph}), "
            f"on 25 % a **{v['a25'].word}** (95 % [{v['a25'].lo}, {v['a25'].hi}], MDE {v['a25'].mde}), on 50 % a "
            f"**{v['a50'].word}** (95 % [{v['a50'].lo}, {v['a50'].hi}]); the growth from 100 % to 10 % "
            f"**{v['g'].word}**, only just (95 % [{v['g'].lo}, {v['g'].hi}], Holm p {v['g'].ph}); LieRE − RoPE-Mixed "
            f"on 10 % **{v['m10'].word}** (95 % [{v['m10'].lo}, {v['m10'].hi}], Holm p {v['m10'].ph})")
    assert text in _flat("data-efficiency-depth6-liere/README.md"), text
    # gpu/README: learnable against fixed, read alone
    gp = _acc(RESULTS / "gpu" / "classify" / "classify.csv", "pe")
    five = range(5)
    v = _V(judge_one([gp[("mixed", s)] - gp[("axial", s)] for s in five]))
    text = f"RoPE-Mixed − axial −0.005 ± 0.005 (4 of 5 below) a {v.label} (95 % [{v.lo}, {v.hi}])"
    assert text in _flat("gpu/README.md"), text
    # classify-normalized's side check: LieRE (normalised) − ComRoPE-LD with its authors' start, read alone
    cn = _acc(RESULTS / "classify-normalized" / "classify-coords.csv", "pe")
    side = {}
    for name in ("classify-seeds0-1.csv", "classify-seed2.csv"):
        side.update(_acc(RESULTS / "classify-normalized" / "comrope-paper-start" / name, "pe"))
    v = _V(judge_one([cn[("liere/normalized", s)] - side[("comrope-ld", s)] for s in seeds]))
    text = f"LieRE − LD +0.027 ± 0.033, a {v.word}, 95 % [{v.lo}, {v.hi}], MDE {v.mde}"
    assert text in _flat("classify-normalized/README.md"), text


def test_the_ablation_readings_of_the_results_readme_match_the_csvs():
    """docs/results/README.md's ablation rows (sharing and jitter, each difference read alone) are what the one rule
    gives on the committed ablations CSVs."""
    from ropekit_studies.verdict import judge_one

    def diffs(folder, group, pe, first, second, column="test_acc"):
        with open(RESULTS / folder / "ablations.csv", newline="") as fh:
            rows = {(r["group"], r["pe"], r["setting"], int(r["seed"])): r for r in csv.DictReader(fh)}
        return [float(rows[(group, pe, first, s)][column]) - float(rows[(group, pe, second, s)][column])
                for s in range(3)]

    def v(*args, **kw):
        return _V(judge_one(diffs(*args, **kw)))

    page = _flat("README.md")
    mixed, cayley = v("ablations", "sharing", "mixed", "model", "head"), v("ablations", "sharing", "cayley", "model",
                                                                           "head")
    commute6 = v("ablations-depth6", "sharing", "liere-commute", "model", "head")
    ap = v("ablations", "sharing", "comrope-ap", "head", "model")
    jm, jc = (v("ablations", "jitter", pe, "σ=1", "σ=0", column="acc_at_36px") for pe in ("mixed", "cayley"))
    jm6, jc6 = (v("ablations-depth6", "jitter", pe, "σ=1", "σ=0", column="acc_at_36px") for pe in ("mixed", "cayley"))
    for text in (f"a **{mixed.word}** for RoPE-Mixed (one per model − per head +0.036 ± 0.018, every seed; 95 % "
                 f"[{mixed.lo}, {mixed.hi}]), a **{cayley.word}** for Cayley (+0.025 ± 0.024, every seed; MDE "
                 f"{cayley.mde})",
                 f"a **{commute6.word}** for LieRE-Commute (+0.025 ± 0.020, every seed; 95 % [{commute6.lo}, "
                 f"{commute6.hi}])",
                 f"AP +0.002 ± 0.001 **{ap.word}** (every seed, 95 % [{ap.lo}, {ap.hi}]",
                 f"RoPE-Mixed **{jm.word}**, +0.076 ± 0.020 (every seed; 95 % [{jm.lo}, {jm.hi}]); Cayley a "
                 f"{jc.word}, +0.049 ± 0.089 (MDE {jc.mde})",
                 f"at 36 px Cayley **{jc6.word}**, +0.061 ± 0.018 (95 % [{jc6.lo}, {jc6.hi}]), RoPE-Mixed a "
                 f"{jm6.word}, +0.072 ± 0.031 (95 % [{jm6.lo}, {jm6.hi}])"):
        assert text in page, text


def test_the_video_side_check_readings_match_their_csvs():
    """video-normalized's side check (ComRoPE with its authors' start): each paired difference of its table read
    alone, word and MDE or interval as the page states them."""
    from ropekit_studies.verdict import judge_one

    side = _acc(RESULTS / "video-normalized" / "comrope-paper-start" / "video.csv", "pe")
    arms = _acc(RESULTS / "video-normalized" / "video-coords.csv", "pe")
    page = _flat("video-normalized/README.md")

    def v(pe, ref):
        return _V(judge_one([side[(pe, s)] - arms[(ref, s)] for s in range(3)]))

    ag, al = v("comrope-ap", "comrope-ap/grid"), v("comrope-ap", "liere/normalized")
    lg, ll = v("comrope-ld", "comrope-ld/grid"), v("comrope-ld", "liere/normalized")
    for text in (f"+0.013 ± 0.013, {ag.word} (every seed positive; MDE {ag.mde}) | +0.011 ± 0.005, {al.word} (95 % "
                 f"[{al.lo}, {al.hi}]) |",
                 f"−0.003 ± 0.012, {lg.word} (MDE {lg.mde}) | −0.003 ± 0.013, {ll.word} (MDE {ll.mde}) |"):
        assert text in page, text


@pytest.mark.parametrize("study,nulls,trends", [("resolution-comrope", 19, 11), ("resolution-comrope-paper", 20, 16)])
def test_the_resolution_comrope_paired_table_matches_its_csv(study, nulls, trends):
    """docs/results/<study>/README.md's paired table (between its markers) is what the CSV gives: the cells one
    Holm family (30 and 36), every null with its MDE."""
    from ropekit_studies.resolution_paired import render_folder

    folder = RESULTS / study
    committed = (folder / "README.md").read_text()
    assert render_folder(folder) == committed, "regenerate: python -m ropekit_studies.resolution_paired " \
                                               f"docs/results/{study}"
    table = committed.split("<!-- paired:begin -->")[1].split("<!-- paired:end -->")[0]
    assert table.count(" null (MDE ") == table.count(" null") == nulls and table.count(" trend") == trends


def test_the_paired_size_table_reads_signs_seeds_and_gaps():
    """A trend against the claimed sign is written "trend (−)", one seed "not assessable", a missing arm is an
    error; the words are judge's over the whole table."""
    from ropekit_studies.resolution_paired import paired_size_table
    from ropekit_studies.verdict import judge

    acc = {("b", 0): 0.50, ("b", 1): 0.52, ("b", 2): 0.51, ("a", 0): 0.45, ("a", 1): 0.51, ("a", 2): 0.48,
           ("c", 0): 0.80}
    rows = [{"mode": "resize", "pe": pe, "image_size": "16", "seed": str(s), "test_acc": str(v), "train_size": "16"}
            for (pe, s), v in acc.items()]
    lines = paired_size_table(rows, "resize", [16], [("a − b", "a", "b")])
    want = judge({"x": [-0.05, -0.01, -0.03]}, {"x": 1})["x"]
    assert want.word == "trend" and want.sign == -1  # t = -2.60: beyond t_(0.9, 2) = 1.89, inside t_(0.975, 2)
    assert lines[0] == "| difference | 16 (train) px |" and "−0.030 ± 0.020 trend (−)" in lines[2]
    one = paired_size_table(rows + [{"mode": "resize", "pe": "b", "image_size": "16", "seed": "9",
                                     "test_acc": "0.5", "train_size": "16"}], "resize", [16], [("c − b", "c", "b")])
    assert "+0.300 not assessable" in one[2]
    with pytest.raises(ValueError, match="no paired runs of a and z"):
        paired_size_table(rows, "resize", [16], [("a − z", "a", "z")])


def test_the_compute_efficiency_depth6_readings_match_its_csv():
    """compute-efficiency-depth6's reading column: LieRE − APE at each length, the four one Holm family."""
    a = _acc(RESULTS / "compute-efficiency-depth6" / "compute-efficiency.csv", "pe", "epochs")
    v = _family({e: [a[("liere", e, s)] - a[("absolute", e, s)] for s in range(3)] for e in ("2", "4", "6", "10")})
    page = _flat("compute-efficiency-depth6/README.md")
    for text in (f"| {v['2'].label} (95 % [{v['2'].lo}, {v['2'].hi}]) |", f"| {v['4'].word} (MDE {v['4'].mde}) |",
                 f"| {v['6'].word} (95 % [{v['6'].lo}, {v['6'].hi}]) |",
                 f"| {v['10'].word} (95 % [{v['10'].lo}, {v['10'].hi}]) |"):
        assert text in page, text


def test_the_owl_readme_quotes_its_generated_table():
    """docs/results/owl/README.md's verdict cells ("mean ± sd word") are the generated table's (table.md, itself
    checked against the CSV above): the same word, and the same MDE beside a null."""
    cell = r"([+\-−]?[0-9]+\.[0-9]+) ± ([0-9.]+)\*{0,2} (holds|reversed|trend|null)(?:\*{0,2} \(MDE ([0-9.]+)\))?"
    table = {}
    for m in re.finditer(r"\| (-?[0-9.]+) ± ([0-9.]+) \| (holds|reversed|trend|null)(?: \(MDE ([0-9.]+)\))? (?=\|)",
                         _flat("owl/table.md")):
        table.setdefault((abs(float(m.group(1))), m.group(2)), []).append((m.group(3), m.group(4)))
    quoted = re.findall(cell, _flat("owl/README.md").replace("| ", " "))
    assert len(quoted) >= 10
    for mean, sd, word, mde in quoted:
        assert (word, mde or None) in table[(abs(float(mean.replace("−", "-"))), sd)], (mean, sd, word, mde)


def test_the_detect3d_rotary_readings_match_its_csv():
    """detect3d's README at the study's length: rotary ViTD − APE / NoPE ViTD, the eight one Holm family, as the
    page states them (words, MDEs, none holding)."""
    with open(RESULTS / "detect3d" / "detect3d.csv", newline="") as fh:
        iou = {(r["encoding"], r["input"], int(r["seed"])): float(r["mean_iou"]) for r in csv.DictReader(fh)}
    v = _family({f"{e} {b}": [iou[(e, "rgbd", s)] - iou[(ref, "rgbd", s)] for s in range(3)]
                 for e in ("axial", "mixed", "cayley", "circulant") for b, ref in (("APE", "absolute"),
                                                                                  ("NoPE", "none"))})
    assert not any(x.word == "holds" for x in v.values()) and min(float(x.ph) for x in v.values()) >= 0.27
    text = (f"− APE +0.035 to +0.057 (axial a {v['axial APE'].word}, MDE {v['axial APE'].mde}; RoPE-Mixed, Cayley, "
            f"Circulant {v['mixed APE'].word}s), − NoPE +0.017 to +0.039 (axial and Cayley {v['axial NoPE'].word}s; "
            f"RoPE-Mixed and Circulant {v['mixed NoPE'].word}s, MDE {v['mixed NoPE'].mde} and "
            f"{v['circulant NoPE'].mde})")
    assert {v["mixed APE"].word, v["cayley APE"].word, v["circulant APE"].word} == {v["mixed APE"].word}
    assert v["cayley NoPE"].word == v["axial NoPE"].word and v["circulant NoPE"].word == v["mixed NoPE"].word
    assert text in _flat("detect3d/README.md"), text


@pytest.mark.parametrize("study", ["resolution-comrope", "resolution-comrope-paper"])
def test_the_declared_paired_comparisons_name_arms_the_recipe_trains(study):
    """Every arm of a declared paired table is one its study's default recipe trains (``ENCODING/CONVENTION``, or
    the plain name of an encoding without coordinates), at sizes the recipe evaluates."""
    from ropekit_studies.recipes import RECIPES
    from ropekit_studies.resolution_paired import PAIRED_TABLES

    rec = RECIPES[study]["default"]["study"]
    modes = rec["options"]["coord_modes"]
    arms = {pe if pe in ("none", "absolute", "sincos") else f"{pe}/{cm}" for pe in rec["pes"] for cm in modes}
    mode, sizes, pairs = PAIRED_TABLES[study]
    assert mode == "resize" and set(sizes) <= set(rec["options"]["sizes"])
    assert {x for _, a, b in pairs for x in (a, b)} <= arms
