//! `cargo xtask bench torch`: PyTorch FSDP2 with and without zeropp.torch, and
//! zeropp's native engine on the same model, on the namespace cluster (2 nodes x 2,
//! the inter-node links shaped to 10 and 50 Mbit/s; `ZEROPP_TORCH_RATES`).
//!
//! FSDP2 runs as users run it: one `torchrun` per node, inside that node's
//! namespace (`cluster.sh --launcher each-node`), gloo over the shaped links,
//! `python/bench/side_by_side.py` timing three variants in one launch. The native
//! engine runs `zeropp train --backend mpi` (ZeRO-3, ZeRO++ and ZeRO++ with SDP4Bit's
//! techniques) on the same shape and the same GPT (d 64, 2 layers, 4 heads, seq 64;
//! global batch 64). `ZEROPP_TORCH_RATES` takes `unshaped` too (no tbf on the uplinks).
//!
//! First, outside the cluster, the compute alone: one training step of the same GPT
//! in torch (`python/bench/compute.py`, one process, one thread, float32) against
//! the engine on one rank (`zeropp train --world 1`, float32, no communication), in
//! three alternating rounds, at two shapes (d 64 × 2 layers, seq 64; d 256 × 4, seq 128;
//! 16 sequences a step).

use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use super::bench::{bench_setup, steady_step_time};
use super::run::kernel_tx;
use super::test::train;
use super::{Launch, Shape, launch, read_metrics, tail, target_dir};
use crate::cmd::root;

/// One row of the report: name, s/step, cross-node bytes per rank per step (the
/// counters of the program), bytes per step on the nodes' uplinks (kernel).
struct Row {
    name: String,
    step_s: f64,
    counted: f64,
    uplink: f64,
    /// The engine's own split of a step (mean over the steps after the first, per
    /// rank): compute, quantization, communication (waits included), optimizer.
    split: Option<[f64; 4]>,
}

/// The mean over `steps` after the first of the engine's `times` record.
fn step_split(steps: &[Value]) -> [f64; 4] {
    let keys = ["compute_s", "quant_s", "comm_s", "optim_s"];
    let rest = steps.get(1..).unwrap_or_default();
    let n = rest.len().max(1) as f64;
    keys.map(|k| rest.iter().filter_map(|s| s.get("times")?.get(k)?.as_f64()).sum::<f64>() / n)
}

/// One compute-only step time of torch (`compute.py`) and of the engine on one
/// rank, for a GPT of width `d`, `layers` blocks and sequence `seq`: `(torch, engine)`
/// medians over 30 steps after warm-up.
fn compute_pair(
    python: &Path,
    zeropp: &Path,
    dir: &Path,
    (d, layers, seq): (usize, usize, usize),
) -> Result<(f64, f64), String> {
    let mut t = std::process::Command::new(python);
    t.arg(root().join("python/bench/compute.py"))
        .args(["--d", &d.to_string(), "--layers", &layers.to_string(), "--seq", &seq.to_string()])
        .args(["--batch", "16", "--steps", "30", "--warmup", "5", "--threads", "1"])
        .env("OMP_NUM_THREADS", "1");
    let out = t.output().map_err(|e| format!("compute.py: {e}"))?;
    if !out.status.success() {
        return Err(format!("compute.py failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let v: Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("compute.py's output: {e}"))?;
    let torch = v.get("step_s").and_then(Value::as_f64).ok_or("compute.py: no step_s")?;
    let metrics = dir.join(format!("engine-d{d}.jsonl"));
    let mut e = std::process::Command::new(zeropp);
    e.args(["train", "--backend", "threads", "--world", "1", "--local-size", "1", "--mode", "zero3"])
        .args(["--comm-dtype", "f32", "--model", &format!("gpt:d={d},layers={layers},heads=4,seq={seq}")])
        .args(["--batch", "16", "--steps", "35", "--eval-batches", "0", "--metrics"])
        .arg(&metrics)
        // One thread, as torch gets: rayon's pool would otherwise take every core.
        .env("RAYON_NUM_THREADS", "1");
    let out = e.output().map_err(|e| format!("zeropp train: {e}"))?;
    if !out.status.success() {
        return Err(format!("zeropp train (compute row) failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    let (steps, _) = read_metrics(&metrics)?;
    // The first 5 steps are warm-up, as in compute.py.
    let mut ts: Vec<f64> =
        steps.iter().skip(5).filter_map(|s| s.get("step_time_s").and_then(Value::as_f64)).collect();
    ts.sort_by(f64::total_cmp);
    let engine = ts.get(ts.len() / 2).copied().ok_or("zeropp train: no step times")?;
    Ok((torch, engine))
}

pub(crate) fn bench(report_dir: &Path) -> Result<(), String> {
    let (zeropp, rates) = bench_setup("torch", "ZEROPP_TORCH_RATES", "10mbit,50mbit,unshaped")?;
    let venv = crate::torch::prepare()?.ok_or("bench torch: no torch venv (see test-torch)")?;
    let base = target_dir().join("cluster/torch");
    let _ = std::fs::remove_dir_all(&base);
    let script = root().join("python/bench/side_by_side.py");
    let python = venv.join("bin/python");
    std::fs::create_dir_all(&base).map_err(|e| format!("{}: {e}", base.display()))?;
    let mut compute = String::from(
        "## Compute alone: one step on one rank and one thread\n\n\
         The GPT of python/tests/gpt.py in float32 with AdamW, 16 sequences a step: torch 2.9 \
         (`python/bench/compute.py`, one thread) against zeropp's engine on one rank (`zeropp train \
         --world 1`, float32, no communication); median step time of 30 steps after 5 of warm-up, \
         three rounds alternating the two.\n\n| shape | engine / torch, per round | engine s/step | torch s/step |\n|---|---|---|---|\n",
    );
    for shape in [(64, 2, 64), (256, 4, 128)] {
        let mut ratios = Vec::new();
        let (mut te, mut tt) = (0.0, 0.0);
        for _ in 0..3 {
            let (torch, engine) = compute_pair(&python, &zeropp, &base, shape)?;
            ratios.push(engine / torch);
            (te, tt) = (engine, torch);
        }
        let r: Vec<String> = ratios.iter().map(|r| format!("{r:.3}")).collect();
        let _ = writeln!(
            compute,
            "| d {} x {} layers, seq {} | {} | {te:.4} | {tt:.4} |",
            shape.0,
            shape.1,
            shape.2,
            r.join(", ")
        );
        eprintln!("bench torch: compute d {}: engine / torch {}", shape.0, r.join(", "));
    }
    let mut md = String::from(
        "# bench `torch`: FSDP2 with and without zeropp.torch, and zeropp's engine, on the namespace cluster\n\n\
         2 nodes x 2 ranks (network namespaces, each node's uplink shaped with tbf), the GPT of \
         python/tests/gpt.py (d 64, 2 layers, 4 heads, seq 64) at 16 sequences per rank. FSDP2: bf16 mixed \
         precision, gloo, one torchrun per node; zeropp's engine: the `gpt` preset under mpirun, bf16 \
         communication. Step time: median of the timed steps after warm-up. Counted bytes: what one rank \
         hands to the collectives for other nodes per step (zeropp.torch.ByteCounter for FSDP2, the \
         engine's own counter); uplink bytes: the kernel's tx counters of both nodes' uplinks per step \
         (TCP/IP framing and gloo's or MPI's own messages included).\n\n",
    );
    for rate in &rates {
        let shape = Shape::new(2, 2, rate);
        let dir = base.join(rate);
        let out_json = dir.join("fsdp2.json");
        let torchrun = "exec \"$0\" -m torch.distributed.run --nnodes=\"$CLUSTER_NODES\" \
             --node-rank=\"$CLUSTER_NODE\" --nproc-per-node=\"$CLUSTER_LOCAL_SIZE\" \
             --master-addr=\"$CLUSTER_MASTER\" --master-port=29411 \"$@\"";
        let args = vec![
            "-c".to_string(),
            torchrun.to_string(),
            python.display().to_string(),
            script.display().to_string(),
            "--out".into(),
            out_json.display().to_string(),
        ];
        let opts = Launch {
            time_limit_s: 900,
            each_node: true,
            env: vec![("OMP_NUM_THREADS".into(), "1".into())],
            ..Launch::default()
        };
        let o = launch(&shape, &dir.join("fsdp2"), &opts, Path::new("bash"), &args, false)?;
        if !o.success {
            return Err(format!("bench torch: FSDP2 at {rate} failed:\n{}", tail(&o.log, 30)));
        }
        let v: Value = serde_json::from_str(
            &std::fs::read_to_string(&out_json).map_err(|e| format!("{}: {e}", out_json.display()))?,
        )
        .map_err(|e| format!("{}: {e}", out_json.display()))?;
        let mut rows: Vec<Row> = v
            .get("rows")
            .and_then(Value::as_array)
            .ok_or("fsdp2.json: no rows")?
            .iter()
            .map(|r| {
                let f = |k: &str| r.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
                Row {
                    name: format!("FSDP2 {}", r.get("variant").and_then(Value::as_str).unwrap_or("?")),
                    step_s: f("step_s"),
                    counted: f("inter_bytes_per_rank"),
                    uplink: f("uplink_tx_bytes_per_step"),
                    split: None,
                }
            })
            .collect();
        let params = v["rows"][0]["params"].as_f64().unwrap_or(0.0);
        // zeropp's native engine, same shape and GPT.
        let steps = 8usize;
        let common =
            ["--model", "gpt", "--steps", "8", "--seed", "1", "--eval-batches", "0", "--batch", "64"];
        for (name, margs) in [
            ("zeropp engine ZeRO-3", &["--mode", "zero3"]),
            ("zeropp engine ZeRO++", &["--mode", "zeropp"]),
            ("zeropp engine ZeRO++ delta", &["--mode", "zeropp-delta"]),
        ] {
            let out = dir.join(name.trim_start_matches("zeropp engine ").replace('+', "p").replace(' ', "-"));
            let lo = Launch { time_limit_s: 600, ..Launch::default() };
            let (o, metrics) = train(&shape, &out, (margs, &common), &lo, &zeropp)?;
            if !o.success {
                return Err(format!("bench torch: {name} at {rate} failed:\n{}", tail(&o.log, 20)));
            }
            let (msteps, _) = read_metrics(&metrics)?;
            let counted = msteps
                .iter()
                .skip(1)
                .filter_map(|s| s.get("inter_node_bytes").and_then(Value::as_f64))
                .sum::<f64>()
                / (msteps.len().saturating_sub(1).max(1)) as f64;
            rows.push(Row {
                name: name.into(),
                step_s: steady_step_time(&msteps),
                counted,
                uplink: kernel_tx(&out)? / steps as f64,
                split: Some(step_split(&msteps)),
            });
        }
        eprintln!("bench torch: {rate} done");
        let _ = writeln!(md, "## inter-node links at {rate}\n");
        let _ = writeln!(md, "FSDP2's GPT: {params:.0} parameters.\n");
        let _ = writeln!(
            md,
            "| variant | s/step | step time / FSDP2 default | cross-node bytes per rank (counted) | / FSDP2 default | uplink bytes per step (kernel) | / FSDP2 default |"
        );
        let _ = writeln!(md, "|---|---|---|---|---|---|---|");
        let (b_t, b_c, b_u) = (rows[0].step_s, rows[0].counted, rows[0].uplink);
        for r in &rows {
            let _ = writeln!(
                md,
                "| {} | {:.3} | {:.3} | {:.0} | {:.3} | {:.0} | {:.3} |",
                r.name,
                r.step_s,
                r.step_s / b_t,
                r.counted,
                r.counted / b_c,
                r.uplink,
                r.uplink / b_u
            );
        }
        let _ = writeln!(
            md,
            "\nThe engine's own split of its step (s per step: the slowest rank's, mean over the steps after the first; step: the median above): compute, \
             quantization, communication (waiting included), optimizer.\n\n\
             | variant | compute | quantization | communication | optimizer | step |\n|---|---|---|---|---|---|"
        );
        for r in &rows {
            if let Some([c, q, m, o]) = r.split {
                let _ = writeln!(md, "| {} | {c:.4} | {q:.4} | {m:.4} | {o:.4} | {:.4} |", r.name, r.step_s);
            }
        }
        md.push('\n');
    }
    md.push_str(&compute);
    let out = report_dir.join("torch.md");
    std::fs::write(&out, &md).map_err(|e| format!("{}: {e}", out.display()))?;
    println!("{md}");
    eprintln!("==> wrote {}", out.display());
    Ok(())
}
