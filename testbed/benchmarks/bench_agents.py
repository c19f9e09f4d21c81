"""Benchmarks of the agents on a real fabric (they print JSON figures; they never assert).

* ``collectives``: Gloo all-reduce and the chunked, pipelined broadcast over 1-256 MiB between 4 agents, each
  on its own ToR so every byte crosses the OCS, with bus bandwidth (nccl-tests convention: all-reduce
  ``2 (n-1)/n x bytes / t``, broadcast ``bytes / t``) and ``efficiency`` = bus bandwidth / the TCP goodput one
  iperf3 stream reaches over the same shaped links in the same run (what htb lets through).
* ``generation``: tokens streamed per second (counted at the collectors) beside the modelled rate (replicas x
  batch / the modelled step time), the token lag of an agent at batch 64 (how long after its step's modelled
  end a token left the agent), and migration downtime and total time against the KV bytes moved, for the
  multi-stage and the stop-and-copy modes side by side (median of ``repeats`` migrations each, every value
  listed).
"""
from __future__ import annotations

import logging
import statistics
import time
from typing import Callable


from emulation.orchestration import EngineSettings
from emulation.scenario import ControllerSettings, Scenario
from emulation.spec import FabricSpec, JobLayout
from emulation.workload import WorkloadSpec
from testbed.cluster.agent_pool import running_cluster
from testbed.cluster.probes import iperf3, iperf3_result

log = logging.getLogger(__name__)

RING = [0, 2, 1, 3]  # the ring the bench installs as circuits (ring_circuits): 0-2, 2-1, 1-3, 3-0


def ring_circuits(spec: FabricSpec, ring: list[int]) -> dict[str, list[list[int]]]:
    """OCS 0's circuits joining the ToRs of ``ring`` (one server per ToR) neighbour to neighbour: ToR
    ``ring[i]``'s uplink 1 to ToR ``ring[i+1]``'s uplink 0, so every hop of the ring has its own circuit."""
    pairs = []
    for i, t in enumerate(ring):
        nxt = ring[(i + 1) % len(ring)]
        pairs.append([spec.uplink(t, 1).ocs_port, spec.uplink(nxt, 0).ocs_port])
    return {"0": pairs}


def bench_scenario(rate_mbps: float, scale: float = 0.001, model: str = "Qwen2.5-7B",
                   host_tcp_cc: str = FabricSpec.host_tcp_cc) -> Scenario:
    """4 servers, one per ToR (2 pods x 2 ToRs), 2 uplinks per ToR on one OCS, every link at ``rate_mbps``."""
    gbps = rate_mbps / 1000.0 / scale
    spec = FabricSpec(pods=2, tors_per_pod=2, servers_per_tor=1, ocs_count=1, uplinks_per_tor=2, server_gbps=gbps,
                      uplink_gbps=gbps, scale=scale, host_tcp_cc=host_tcp_cc)
    return Scenario(name="bench-agents", seed=1, fabric=spec, layout=JobLayout((0,), (1,)),
                    workload=WorkloadSpec(model=model, gpu="H800", prompts_per_step=4, samples_per_prompt=4),
                    controller=ControllerSettings(initial_phase="train"))


def _span(res: dict) -> float:
    """A broadcast is done when its last rank is: from the moment its root started sending (the ranks that
    only receive start waiting earlier) to the last rank's end."""
    roots = [r for r in res.values() if not r["sources"]]
    return max(r["end_mono"] for r in res.values()) - min(r["start_mono"] for r in roots)


def bench_collectives(sizes_mib=(1, 4, 16, 64, 256), rate_mbps: float = 400.0, bucket_mib: float = 0.5,
                      iperf_s: float = 4.0, progress: Callable[[int], None] | None = None,
                      host_tcp_cc: str = FabricSpec.host_tcp_cc) -> dict:
    scn = bench_scenario(rate_mbps, host_tcp_cc=host_tcp_cc)
    rows = []
    with running_cluster(scn) as (tb, pool):
        tb.client.set_circuits(ring_circuits(scn.fabric, RING))  # not a phase topology: the bench's own ring
        pool.form_world(RING)  # ring order = circuit order: Gloo's ring follows the ranks
        pool.form_group("all", RING)
        goodput = iperf3_result(iperf3(tb.fabric, 0, 2, iperf_s, port=5501), iperf_s + 20)["bps"]
        done = 0
        for mib in sizes_mib:
            nbytes = int(mib * 2**20)
            iters = 3  # medians of 3: a single transfer on this shared machine can lose one TCP timeout
            res = pool.call_all(RING, "all_reduce", lambda s: {"group": "all", "nbytes": nbytes, "iters": iters,
                                                                "timeout_s": 600}, 900)
            t = statistics.median(max(r["times_s"][i] for r in res.values()) for i in range(iters))
            n = len(RING)
            busbw = 2 * (n - 1) / n * nbytes * 8 / t
            rows.append({"op": "all_reduce", "bytes": nbytes, "ranks": n, "time_s": round(t, 4),
                         "busbw_gbps": round(busbw / 1e9, 4), "efficiency": round(busbw / goodput, 3),
                         "correct": all(r["correct"] for r in res.values())})
            # pipelined broadcast along the ring's circuits: 0 -> 2 -> 1 -> 3
            times, crcs = [], set()
            for it in range(iters):
                plan = {RING[0]: {"children": [{"agent": RING[1]}]}}
                for i in range(1, n):
                    plan[RING[i]] = {"sources": [[RING[i - 1], 1.0]],
                                     "children": [{"agent": RING[i + 1]}] if i + 1 < n else []}
                res = pool.call_all(RING, "broadcast", lambda s: {"nbytes": nbytes, "bucket_bytes": int(bucket_mib * 2**20),
                                                                   "tag": 100 + it, "version": it, "timeout_s": 600,
                                                                   **plan[s]}, 900)
                times.append(_span(res))
                crcs.add(frozenset(r["crc32"] for r in res.values()))
            t = statistics.median(times)
            busbw = nbytes * 8 / t
            rows.append({"op": "broadcast_pipelined", "bytes": nbytes, "ranks": n, "time_s": round(t, 4),
                         "busbw_gbps": round(busbw / 1e9, 4), "efficiency": round(busbw / goodput, 3),
                         "depth": n - 1, "bucket_bytes": int(bucket_mib * 2**20),
                         "correct": all(len(c) == 1 for c in crcs)})
            done += 1
            if progress:
                progress(done)
    big = [r["efficiency"] for r in rows if r["bytes"] >= 16 * 2**20]
    return {"rate_mbps": rate_mbps, "host_tcp_cc": host_tcp_cc, "goodput_mbps": round(goodput / 1e6, 2), "rows": rows,
            "efficiency_min_ge_16mib": min(big) if big else None,
            "note": "efficiency = bus bandwidth / iperf3 TCP goodput over the same shaped links, same run"}


def bench_generation(rate_mbps: float = 400.0, batch: int = 64, measure_s: float = 8.0,
                     kv_tokens=(512, 2048, 8192, 16384), repeats: int = 5,
                     progress: Callable[[int], None] | None = None) -> dict:
    scn = bench_scenario(rate_mbps)
    gen = 2
    out: dict = {"batch": batch, "rate_mbps": rate_mbps, "model": scn.workload.model}
    with running_cluster(scn, engine=EngineSettings(max_num_seqs=batch)) as (tb, pool):
        tb.client.set_phase("gen")
        replicas = scn.fabric.gpus_per_server // scn.workload.rollout_tp
        n = batch * replicas
        pool.submit(gen, [{"rid": r, "prompt": 256, "target": 100_000, "dest": r % 2} for r in range(n)])
        time.sleep(2.0)  # prefills done: every replica decodes at batch `batch`
        pool.call(gen, "fidelity", {"clear": True})
        c0, t0 = pool.collected().summary["tokens_unique"], time.monotonic()
        time.sleep(measure_s)
        c1, t1 = pool.collected().summary["tokens_unique"], time.monotonic()
        fid = pool.call(gen, "fidelity")
        st = pool.call(gen, "stats")
        out.update(tokens_per_s=round((c1 - c0) / (t1 - t0), 1),
                   modelled_tokens_per_s=round(n / (fid["modelled_step_ms_p50"] / 1e3), 1),
                   engine_decode_tokens_per_s=round(st["decode_tokens_per_s"], 1),
                   token_lag_ms_p50=round(fid["lag_ms_p50"], 4),
                   token_lag_ms_p99=round(fid["lag_ms_p99"], 4),
                   modelled_step_ms_p50=round(fid["modelled_step_ms_p50"], 3), steps=fid["steps"],
                   batch_p50=fid["batch_p50"])
        pool.call(gen, "reset")
        if progress:
            progress(1)
        rows = []
        rid = 50_000
        for k in kv_tokens:
            for mode in ("stop_copy", "multi_stage"):
                down, total, stages, kvb = [], [], [], None
                for _ in range(repeats):
                    rid += 1
                    pool.submit(gen, [{"rid": rid, "prompt": k, "target": 100_000, "dest": 0}])
                    deadline = time.monotonic() + 30
                    while time.monotonic() < deadline:  # until it decodes (its prefill is done)
                        if pool.collected().by_rid().get(rid, 0) >= 5:
                            break
                        time.sleep(0.05)
                    res = pool.migrate(rid, gen, 3, mode=mode)
                    pool.call(3, "reset")
                    down.append(res["downtime_s"] * 1e3)
                    total.append(res["total_s"] * 1e3)
                    stages.append(len(res["stages"]))
                    kvb = res.get("kv_bytes")
                rows.append({"mode": mode, "kv_tokens": int(k), "kv_bytes": kvb,
                             "downtime_ms": round(statistics.median(down), 3), "total_ms": round(statistics.median(total), 3),
                             "downtime_ms_each": [round(x, 3) for x in down], "stages": int(statistics.median(stages))})
            if progress:
                progress(1)
        out["migration"] = rows
        out["fidelity"] = fid
    return out


A2A_TOPOLOGIES = ("train", "train:mp")  # one train topology, and the EP stage's own (controller.train_rewire)


def bench_alltoall(scenario, repeats: int = 3, topologies=A2A_TOPOLOGIES,
                   progress: Callable[[int], None] | None = None) -> dict:
    """The live loop's MoE all-to-all against RLSim's flow model of it: ``repeats`` train phases
    (``EmulatedBackend.train``, the real Gloo exchange of the scaled expert activations in its layer groups)
    on each of ``topologies``, every request at the workload's median length, and per topology the measured
    span over the modelled one (the ratio the cross-check and the fidelity monitor judge). ``scenario``: an
    MoE scenario small enough to emulate (scenarios/moe-small.yaml)."""
    import dataclasses

    import numpy as np

    from agents.engine import Layout
    from testbed.backends.emulated import EmulatedBackend

    w = scenario.workload
    lengths = np.full(w.prompts_per_step * w.samples_per_prompt, int(w.response_median_tokens))
    rewired = dataclasses.replace(scenario, controller=dataclasses.replace(scenario.controller, train_rewire=True))
    rows, done = [], 0
    with running_cluster(scenario) as (tb, pool):
        gps = scenario.fabric.gpus_per_server
        layouts = {s: Layout.parse(f"TP{gps}x1", gps) for s in pool.generators}
        for topo in topologies:
            b = EmulatedBackend(rewired if topo == "train:mp" else scenario, layouts, cluster=(tb, pool))
            if b.model.train_layout.ep <= 1:
                raise ValueError(f"scenario {scenario.name!r} trains a dense model: no all-to-all to time")
            d = b.set_phase(topo, None, None)
            if tb.client.state().get("topology", tb.client.state().get("phase")) != topo:
                raise RuntimeError(f"the controller did not install {topo!r}: {d.to_json()}")
            runs = []
            for k in range(repeats):
                tr = b.train(k, lengths)
                runs.append({"measured_s": round(tr.detail["alltoall_s"], 4),
                             "modelled_s": round(tr.detail["modelled_alltoall_s"], 4),
                             "ratio": round(tr.detail["alltoall_s"] / tr.detail["modelled_alltoall_s"], 4),
                             "correct": bool(tr.detail["correct"])})
                done += 1
                if progress:
                    progress(done)
            rows.append({"topology": topo, "bytes_per_rank": tr.detail["alltoall_bytes"],
                         "ratio_median": round(statistics.median(r["ratio"] for r in runs), 4),
                         "ratio_max": max(r["ratio"] for r in runs), "runs": runs})
    return {"scenario": scenario.name, "host_tcp_cc": scenario.fabric.host_tcp_cc,
            "link_mbps": scenario.fabric.server_link_mbps, "requests": len(lengths),
            "length": int(lengths[0]), "rows": rows,
            "note": "ratio = the emulated all-to-all's span / RLSim's flow-model time of the same bytes on the same "
                    "topology (1.0: the fluid max-min exchange; the links' TCP goodput alone is ~0.955 of their rate)"}
