//! `cargo xtask bench torch`: PyTorch FSDP2 with and without zeropp.torch, and
//! zeropp's native engine on the same model, on the namespace cluster (2 nodes x 2,
//! the inter-node links shaped to 10 and 50 Mbit/s; `ZEROPP_TORCH_RATES`).
//!
//! FSDP2 runs as users run it: one `torchrun` per node, inside that node's
//! namespace (`cluster.sh --launcher each-node`), gloo over the shaped links,
//! `python/bench/side_by_side.py` timing three variants in one launch. The native
//! engine runs `zeropp train --backend mpi` (ZeRO-3 and ZeRO++) on the same shape
//! and the same GPT (d 64, 2 layers, 4 heads, seq 64; global batch 64).

use std::fmt::Write as _;
use std::path::Path;

use serde_json::Value;

use super::bench::{bench_setup, steady_step_time};
use super::run::kernel_tx;
use super::test::train;
use super::{Launch, Shape, launch, read_metrics, tail, target_dir};
use crate::root;

/// One row of the report: name, s/step, cross-node bytes per rank per step (the
/// counters of the program), bytes per step on the nodes' uplinks (kernel).
struct Row {
    name: String,
    step_s: f64,
    counted: f64,
    uplink: f64,
}

pub(crate) fn bench(report_dir: &Path) -> Result<(), String> {
    let (zeropp, rates) = bench_setup("torch", "ZEROPP_TORCH_RATES", "10mbit,50mbit")?;
    let venv = crate::torch::prepare()?.ok_or("bench torch: no torch venv (see test-torch)")?;
    let base = target_dir().join("cluster/torch");
    let _ = std::fs::remove_dir_all(&base);
    let script = root().join("python/bench/side_by_side.py");
    let python = venv.join("bin/python");
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
                }
            })
            .collect();
        let params = v["rows"][0]["params"].as_f64().unwrap_or(0.0);
        // zeropp's native engine, same shape and GPT.
        let steps = 8usize;
        let common =
            ["--model", "gpt", "--steps", "8", "--seed", "1", "--eval-batches", "0", "--batch", "64"];
        for (name, margs) in
            [("zeropp engine ZeRO-3", &["--mode", "zero3"]), ("zeropp engine ZeRO++", &["--mode", "zeropp"])]
        {
            let out = dir.join(name.rsplit(' ').next().unwrap_or("x").replace('+', "p"));
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
        md.push('\n');
    }
    let out = report_dir.join("torch.md");
    std::fs::write(&out, &md).map_err(|e| format!("{}: {e}", out.display()))?;
    println!("{md}");
    eprintln!("==> wrote {}", out.display());
    Ok(())
}
