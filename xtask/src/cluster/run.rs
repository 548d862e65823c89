//! `cargo xtask cluster run`: one `zeropp train --backend mpi` across the cluster, and
//! its one-line summary from the metrics and the kernel's interface counters
//! (`netdev.json`), which the cluster tests also read.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::{HELP, Launch, Outcome, Shape, build_zeropp, launch, read_metrics, target_dir, value};

pub(super) fn run_cmd(args: &[String]) -> Result<(), String> {
    let mut shape = Shape::new(2, 4, "unshaped");
    let mut out = None;
    let mut release = true;
    let mut time_limit_s = 1800;
    let split = args.iter().position(|a| a == "--").unwrap_or(args.len());
    let (ours, train) = (&args[..split], args.get(split + 1..).unwrap_or(&[]));
    let mut i = 0;
    while i < ours.len() {
        let flag = ours[i].as_str();
        match flag {
            "--nodes" => shape.nodes = parse_num(value(ours, &mut i, flag)?, flag)?,
            "--local-size" => shape.local_size = parse_num(value(ours, &mut i, flag)?, flag)?,
            "--rate" => shape.rate = value(ours, &mut i, flag)?.into(),
            "--delay" => shape.delay = value(ours, &mut i, flag)?.into(),
            "--loss" => shape.loss = Some(value(ours, &mut i, flag)?.into()),
            "--jitter" => shape.jitter = Some(value(ours, &mut i, flag)?.into()),
            "--queue" => shape.queue = Some(value(ours, &mut i, flag)?.into()),
            "--out" => out = Some(PathBuf::from(value(ours, &mut i, flag)?)),
            "--time-limit" => time_limit_s = parse_num(value(ours, &mut i, flag)?, flag)? as u64,
            "--debug" => release = false,
            other => return Err(format!("cluster run: unknown option `{other}`\n\n{HELP}")),
        }
        i += 1;
    }
    if shape.nodes < 1 || shape.local_size < 1 {
        return Err("cluster run: --nodes and --local-size must be at least 1".into());
    }
    let out = out.unwrap_or_else(|| target_dir().join("cluster").join(format!("run-{}", std::process::id())));
    let zeropp = build_zeropp(release, "dev")?;
    let metrics = out.join("metrics.jsonl");
    let _ = std::fs::remove_file(&metrics);
    let mut targs: Vec<String> = vec!["train".into(), "--backend".into(), "mpi".into()];
    targs.extend(["--local-size".into(), shape.local_size.to_string()]);
    targs.extend(train.iter().cloned());
    targs.extend(["--metrics".into(), metrics.display().to_string()]);
    let outcome = launch(&shape, &out, &Launch { time_limit_s, ..Launch::default() }, &zeropp, &targs, true)?;
    println!("{}", summary_line(&shape, &out, &outcome));
    if outcome.success { Ok(()) } else { Err(format!("the cluster run failed (exit {:?})", outcome.code)) }
}

fn parse_num(s: &str, flag: &str) -> Result<usize, String> {
    s.parse().map_err(|_| format!("{flag}: `{s}` is not a whole number"))
}

/// Kernel bytes sent by all nodes' uplinks during the run (the cross-node traffic: a
/// node's uplink carries nothing else).
pub(super) fn kernel_tx(out: &Path) -> Result<f64, String> {
    let path = out.join("netdev.json");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let nodes = v.get("nodes").and_then(Value::as_array).ok_or("netdev.json: no nodes")?;
    Ok(nodes
        .iter()
        .map(|n| {
            let f = |k: &str| n.get(k).and_then(Value::as_f64).unwrap_or(0.0);
            f("tx_bytes_after") - f("tx_bytes_before")
        })
        .sum())
}

/// The project's inter-node bytes of the whole run, all ranks (the metrics hold means per rank).
pub(super) fn project_inter(steps: &[Value], world: usize) -> f64 {
    steps.iter().filter_map(|s| s.get("inter_node_bytes").and_then(Value::as_f64)).sum::<f64>() * world as f64
}

fn summary_line(shape: &Shape, out: &Path, o: &Outcome) -> String {
    let mut line = format!(
        "cluster: {}x{} at {} (delay {}{}), exit {}, {:.1} s",
        shape.nodes,
        shape.local_size,
        shape.rate,
        shape.delay,
        shape.loss.as_ref().map_or(String::new(), |l| format!(", loss {l}%")),
        o.code.map_or("signal".into(), |c| c.to_string()),
        o.wall_s
    );
    if let Ok((steps, summary)) = read_metrics(&out.join("metrics.jsonl")) {
        let f = |k: &str| summary.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
        let inter = project_inter(&steps, shape.world());
        let _ = write!(
            line,
            "; {} steps, mean step {:.4} s, final loss {:.6}; inter-node bytes: project {:.0}",
            steps.len(),
            f("mean_step_time_s"),
            f("final_loss"),
            inter
        );
        if let Ok(k) = kernel_tx(out) {
            let _ = write!(line, ", kernel {k:.0} (kernel/project {:.3})", k / inter);
        }
    } else if let Ok(k) = kernel_tx(out) {
        let _ = write!(line, "; kernel tx {k:.0} bytes");
    }
    let _ = write!(line, "; {}", out.display());
    line
}
