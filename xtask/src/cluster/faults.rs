//! `cargo xtask test-cluster --faults`: the network fault tests (1% packet loss, a link
//! down mid-run and the checkpoint that resumes after it, a node's ranks killed).

use std::path::Path;

use serde_json::Value;

use super::checks::{Tally, same_losses, threads_run, train_args};
use super::{Launch, Shape, launch, read_metrics, tail};

pub(super) fn fault_tests(zeropp: &Path, base: &Path, t: &mut Tally) -> Result<(), String> {
    let common = ["--model", "gpt-tiny", "--seed", "5", "--eval-batches", "0"];
    let shape = Shape::new(2, 2, "100mbit");
    let timeout_s = 10u64;

    // 1% loss: same losses as the lossless run.
    let mut lossy = shape.clone();
    lossy.loss = Some("1".into());
    let out = base.join("loss");
    let m_loss = out.join("metrics.jsonl");
    let targs = train_args(&lossy, &["--mode", "zeropp", "--steps", "10"], &common, &m_loss);
    let o = launch(&lossy, &out, &Launch { time_limit_s: 300, ..Launch::default() }, zeropp, &targs, false)?;
    let reference = out.join("threads.jsonl");
    let verdict = if o.success {
        threads_run(
            zeropp,
            &shape,
            &["--mode".into(), "zeropp".into(), "--steps".into(), "10".into()]
                .into_iter()
                .chain(common.iter().map(|s| s.to_string()))
                .collect::<Vec<_>>(),
            &reference,
            None,
        )
        .and_then(|()| same_losses(&m_loss, &reference))
        .and_then(|d| {
            let drops: Vec<&str> = o.log.lines().filter(|l| l.contains("dropped")).collect();
            if drops.is_empty() || drops.iter().any(|l| l.contains("packets 0 ") || l.contains("? packets")) {
                Err(format!("no packet was dropped: {drops:?}"))
            } else {
                Ok(format!("{d} ({:.1} s); {}", o.wall_s, drops.join("; ")))
            }
        })
    } else {
        Err(tail(&o.log, 20))
    };
    t.check("1% packet loss: losses equal the lossless run", verdict);

    // Link down mid-run: an error within --timeout, and the last checkpoint resumes bitwise.
    let out = base.join("linkdown");
    let ckpt = out.join("ckpt");
    let m = out.join("metrics.jsonl");
    // Far more steps than 6 s allow (gpt-tiny takes milliseconds a step): the fault ends it.
    let steps = ["--mode", "zeropp", "--steps", "1000000", "--save-every", "100", "--timeout", "10"];
    let mut targs = train_args(&shape, &steps, &common, &m);
    targs.extend(["--save".into(), ckpt.display().to_string()]);
    // The bound: the fault at 6 s, --timeout for rank 0's watchdog, the cluster's 15 s
    // grace for mpirun to end the job, and 10 s of start-up and slack.
    let bound = 6 + timeout_s + 15 + 10;
    let limit = bound + 60;
    let o = launch(
        &shape,
        &out,
        &Launch { time_limit_s: limit, fault: Some("linkdown:1:6".into()), ..Launch::default() },
        zeropp,
        &targs,
        false,
    )?;
    let named = o.log.lines().find(|l| l.contains("fatal:")).unwrap_or("").trim().to_string();
    let verdict = if o.success {
        Err("the run succeeded although node 1's link went down".into())
    } else if o.wall_s > bound as f64 {
        Err(format!("ended after {:.0} s, past the bound of {bound} s", o.wall_s))
    } else if named.is_empty() {
        Err(format!("no error message naming the failure:\n{}", tail(&o.log, 15)))
    } else {
        Ok(format!(
            "ended after {:.1} s (bound {bound} s: link down at 6 s, --timeout {timeout_s}, 15 s grace), {}: {named}",
            o.wall_s,
            ended_by(&o.log)
        ))
    };
    t.check("link down mid-run: error within the bound", verdict);
    // Resume the last committed checkpoint on the thread backend, and compare with an
    // uninterrupted run to the same step.
    let resumed = (|| {
        let saved = read_metrics(&m).map(|(s, _)| s.len()).unwrap_or(0);
        // The checkpoint is at or before the last step with metrics: resume past that.
        let resume_to = saved + 50;
        let r_out = out.join("resumed.jsonl");
        let full_out = out.join("full.jsonl");
        let mut a: Vec<String> = ["--mode", "zeropp", "--steps", &resume_to.to_string()]
            .iter()
            .chain(&common)
            .map(|s| s.to_string())
            .collect();
        let plain = a.clone();
        a.extend(["--resume".into(), ckpt.display().to_string()]);
        threads_run(zeropp, &shape, &a, &r_out, None)?;
        threads_run(zeropp, &shape, &plain, &full_out, None)?;
        let (rs, ru) = read_metrics(&r_out)?;
        let (fs, fu) = read_metrics(&full_out)?;
        let first = rs
            .first()
            .and_then(|s| s.get("step"))
            .and_then(Value::as_u64)
            .ok_or("the resumed run has no steps")?;
        for r in &rs {
            let step = r.get("step").and_then(Value::as_u64).unwrap_or(u64::MAX);
            let f = fs.get(step as usize).ok_or("step missing in the full run")?;
            if r.get("loss") != f.get("loss") {
                return Err(format!(
                    "step {step}: loss {:?} vs uninterrupted {:?}",
                    r.get("loss"),
                    f.get("loss")
                ));
            }
        }
        if ru.get("final_loss") != fu.get("final_loss") {
            return Err("final losses differ".into());
        }
        Ok(format!(
            "resumed at step {first} (metrics of {saved} steps written before the fault), {} steps bitwise equal to the uninterrupted run",
            rs.len()
        ))
    })();
    t.check("link down: the last checkpoint resumes bitwise", resumed);

    // Every rank of node 1 killed: the job ends with an error, node 0's ranks exit.
    let out = base.join("killnode");
    let m = out.join("metrics.jsonl");
    let targs =
        train_args(&shape, &["--mode", "zeropp", "--steps", "1000000", "--timeout", "10"], &common, &m);
    let o = launch(
        &shape,
        &out,
        &Launch { time_limit_s: 120, fault: Some("killnode:1:6".into()), ..Launch::default() },
        zeropp,
        &targs,
        false,
    )?;
    // Bound: the fault at 6 s, the 15 s grace, 10 s of start-up and slack.
    let verdict = if o.success {
        Err("the run succeeded although node 1's ranks were killed".into())
    } else if o.wall_s > 31.0 {
        Err(format!("ended after {:.0} s, past the bound of 31 s", o.wall_s))
    } else if !o.log.contains("exited on signal 9") {
        Err(format!("no message naming the killed ranks:\n{}", tail(&o.log, 15)))
    } else {
        let line = o.log.lines().find(|l| l.contains("exited on signal")).unwrap_or("").trim().to_string();
        Ok(format!("ended after {:.1} s, exit {:?}, {}: {line}", o.wall_s, o.code, ended_by(&o.log)))
    };
    t.check("every rank of node 1 killed: the job ends with an error", verdict);
    Ok(())
}

/// Who ended a failed job: mpirun itself, or the cluster's reaper after the grace period.
fn ended_by(log: &str) -> &'static str {
    if log.contains("was still running") { "ended by the cluster's reaper" } else { "ended by mpirun" }
}
