"""Capacity planning for tiered KV caches: ``tierkv plan``.

From a model (built-in table or a Hugging Face ``config.json``), a hardware profile
(shipped in ``tierkv/plan/profiles/*.toml``, or any TOML file) and a workload (Mooncake
trace, the synthetic mix or a few parameters) to tier sizes, prefix hit rates, required
bandwidth, load-versus-recompute crossovers, NIC load with and without DualPath, and the
cheapest configuration meeting a target. Modules, in the order the planner uses them:
``models``, ``hardware``, ``hitrate`` (the seam to ``tierkv.sim``), ``costs``, ``sizing``,
``evaluate``, ``network``, ``recommend``, ``planner``, ``report``, ``plot``; the workloads
come from :mod:`tierkv.workload`. The CLI registers :func:`tierkv.cli.plan.add_parser`; the model of every output is in
``docs/plan.md``. Nothing is imported here, so registering the subcommand stays cheap:
import the modules (``tierkv.plan.planner.make_plan``, ``tierkv.plan.hitrate.hit_rate_curve``).
"""
