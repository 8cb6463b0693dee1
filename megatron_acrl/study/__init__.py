"""The mismatch study: grids of arms x seeds through the real loop, then one report with plots.

    python -m megatron_acrl.study configs/study/dense.yaml configs/study/moe_stress.yaml \\
        --out runs/study --report docs/study

A grid file names a base config, overrides common to every run, the seeds, and the arms (each a
list of overrides: BF16 rollout, FP8 with none / tis / seq_mis / icepop / acrl / acrl extensions,
optionally under the stress quantization). Every run is ``python -m megatron_acrl.train`` in its
own process (torchrun when the layout has several ranks), so arms share nothing but the cached
supervised warm-start (one per seed: every arm of a seed starts RL from the same policy) and, with
``shared_server: true`` (the default), one SGLang server per grid (two when some arms emulate an FP8
KV cache, a launch-time setting): each run pushes its own initial
weights before its first rollout, so a server that outlives the previous run serves exactly what a
fresh one would, and the grid saves a server start-up per run.

Run directories are ``<out>/<arm>-s<seed>``; arm names are unique across grids, and a finished run
whose overrides are unchanged is reused (two grids may share their BF16 baseline arm). The report
(``REPORT.md``) has, per grid, the paper's table -- peak and mean-of-last-20% reward per arm, mean
+- std over seeds, collapsed yes/no --, the goal verdict stated with its numbers, and PNG curves of
the per-arm mean over seeds drawn with matplotlib from the runs' ``metrics.jsonl``.

An *exact* grid (``kind: exact``, issue #23) judges its arms on the exact metric (``eval/exact_j``
on the trainer's weights, ``eval/exact_j_served`` on the served copy:
:mod:`megatron_acrl.rollout.evaluate`)
instead of the sampled reward, names the role of each arm in its verdicts, and may name a pilot grid
whose numbers (kept in an archive beside the report) and the choices made from them go into its
section. ``make study`` runs the stress + lag grid (docs/study/README.md).

Rooms: :mod:`~megatron_acrl.study.grid` (grid files, arms, seeds, roles), :mod:`~megatron_acrl.study.run`
(running arms and grids, shared servers, ``--jobs`` and seed shards, failed runs, CPU accounting),
:mod:`~megatron_acrl.study.stats` (per-run summaries, means over seeds, paired intervals),
:mod:`~megatron_acrl.study.exact` (exact grids' runs, archives and summaries),
:mod:`~megatron_acrl.study.verdicts` (the exact grids' verdicts and the pilot's go / no-go),
:mod:`~megatron_acrl.study.exact_report` (an exact grid's section and figures),
:mod:`~megatron_acrl.study.report` (the reward grids' verdicts and figures, ``REPORT.md``),
:mod:`~megatron_acrl.study.cli` (the command line).
"""
