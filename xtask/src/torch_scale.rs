//! `cargo xtask bench torch-scale`: PyTorch FSDP2 with and without zeropp.torch
//! at real size (issue 37): a Hugging Face `LlamaForCausalLM` of 99.5M parameters
//! on 2 nodes x 2 ranks (gloo, unshaped localhost), one 128-token sequence per rank
//! per step, `python/bench/scale.py` once per variant and round (a process's peak
//! memory is its own), the variants alternating over `ZEROPP_SCALE_ROUNDS` rounds
//! (default 2).
//!
//! Every figure is a ratio to FSDP2's default in the same run: the median step,
//! the peak resident memory of the largest rank over the timed steps (and over the
//! whole process), what zeropp keeps between steps against the rank's parameter
//! shard, and the step split (torch.distributed's waits, zeropp's kernels, the rest
//! of zeropp's collectives). The report goes to `target/bench-report/torch-scale.md`.
//! It needs `transformers`, installed into the torch venv on first use.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

use crate::cmd::run;
use crate::torch::{prepare, torchrun};

/// (row name, scale.py arguments, ZEROPP_TORCH_KERNELS).
const VARIANTS: &[(&str, &[&str], &str)] = &[
    ("FSDP2 default", &["--variant", "default", "--hpz", "none"], "auto"),
    ("FSDP2, its own hpZ (reshard_after_forward=2)", &["--variant", "default", "--hpz", "fsdp2"], "auto"),
    ("zeropp, Rust kernels, zeropp's hpZ (the recipe)", &["--variant", "zeropp", "--hpz", "zeropp"], "auto"),
    ("zeropp, torch-op kernels, zeropp's hpZ", &["--variant", "zeropp", "--hpz", "zeropp"], "torch"),
    (
        "zeropp, Rust kernels, zeropp's hpZ, qgZ unrotated (qgz_hadamard=False)",
        &["--variant", "zeropp", "--hpz", "zeropp", "--enable", "qgz_hadamard=0"],
        "auto",
    ),
    (
        "zeropp, Rust kernels, zeropp's hpZ, every qgZ group rotated (qgz_hadamard=True)",
        &["--variant", "zeropp", "--hpz", "zeropp", "--enable", "qgz_hadamard=1"],
        "auto",
    ),
    ("zeropp, Rust kernels, FSDP2's hpZ", &["--variant", "zeropp", "--hpz", "fsdp2"], "auto"),
    ("zeropp, Rust kernels, no hpZ", &["--variant", "zeropp", "--hpz", "none"], "auto"),
];

fn num(v: &Value, k: &str) -> f64 {
    v.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

fn max_of(v: &Value, k: &str) -> f64 {
    v.get(k)
        .and_then(Value::as_array)
        .map_or(f64::NAN, |a| a.iter().filter_map(Value::as_f64).fold(0.0, f64::max))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

pub(crate) fn bench(report_dir: &Path) -> Result<(), String> {
    let venv = prepare()?.ok_or("bench torch-scale: no torch venv")?;
    let python = venv.join("bin/python");
    let has = Command::new(&python).args(["-c", "import transformers"]).status().is_ok_and(|s| s.success());
    if !has {
        let mut c = Command::new(venv.join("bin/pip"));
        c.args(["install", "--quiet", "--disable-pip-version-check", crate::torch::TRANSFORMERS]);
        run("pip install transformers (the bench's Llama)", c)?;
    }
    let rounds: usize = std::env::var("ZEROPP_SCALE_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let dir = crate::cmd::root().join("target/torch-scale");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // `ZEROPP_SCALE_BEFORE=DIR`: an earlier build of the package (`pip install --target
    // DIR ./python` from an older checkout) measured beside this one, with the recipe of
    // its day (FSDP2's hpZ), in the same rounds.
    let before = std::env::var("ZEROPP_SCALE_BEFORE").ok().filter(|v| !v.is_empty());
    let mut variants: Vec<(String, Vec<&str>, &str, Option<&str>)> =
        VARIANTS.iter().map(|(n, a, k)| (n.to_string(), a.to_vec(), *k, None)).collect();
    if let Some(dir) = before.as_deref() {
        for kernels in ["auto", "torch"] {
            let which = if kernels == "auto" { "Rust" } else { "torch-op" };
            let name = format!("before ({dir}): zeropp, {which} kernels, FSDP2's hpZ");
            variants.push((name, vec!["--variant", "zeropp", "--hpz", "fsdp2"], kernels, Some(dir)));
        }
    }
    let mut results: Vec<Vec<Value>> = vec![Vec::new(); variants.len()];
    let mut retried: Vec<String> = Vec::new();
    for round in 0..rounds {
        for (i, (name, args, kernels, pythonpath)) in variants.iter().enumerate() {
            let out = dir.join(format!("v{i}-r{round}.json"));
            let out_s = out.display().to_string();
            let mut all: Vec<&str> = vec!["--out", out_s.as_str()];
            all.extend_from_slice(args);
            let mut c = torchrun(&venv, "python/bench/scale.py", &all, None)?;
            c.env("ZEROPP_TORCH_KERNELS", kernels);
            if let Some(p) = pythonpath {
                c.env("PYTHONPATH", p);
            }
            let step = format!("torch-scale round {}: {name}", round + 1);
            if let Err(e) = run(&step, c) {
                // One retry, said in the report: a run that fails twice fails the bench.
                eprintln!("==> {step} failed ({e}); running it once more");
                retried.push(step.clone());
                let mut again = torchrun(&venv, "python/bench/scale.py", &all, None)?;
                again.env("ZEROPP_TORCH_KERNELS", kernels);
                if let Some(p) = pythonpath {
                    again.env("PYTHONPATH", p);
                }
                run(&step, again)?;
            }
            let text = std::fs::read_to_string(&out).map_err(|e| format!("{}: {e}", out.display()))?;
            results[i].push(serde_json::from_str(&text).map_err(|e| format!("{}: {e}", out.display()))?);
        }
    }
    let med = |i: usize, f: &dyn Fn(&Value) -> f64| median(results[i].iter().map(f).collect());
    let base_step = med(0, &|v| num(v, "step_s"));
    let base_peak = med(0, &|v| max_of(v, "peak_bytes"));
    let base_proc = med(0, &|v| max_of(v, "peak_process_bytes"));
    let first = results.first().and_then(|r| r.first()).cloned().unwrap_or(Value::Null);
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# bench `torch-scale`: FSDP2 with and without zeropp.torch at {:.1}M parameters\n\n\
         HF `LlamaForCausalLM` (vocab 32000, d 768, 8 layers, 12/4 heads, MLP 2048), {} ranks as 2 nodes x 2 \
         (gloo, unshaped localhost), {} tokens per rank per step, AdamW, torch {}; medians over {rounds} \
         alternating rounds of one launch per variant (5 timed steps after 1 warm-up each). FSDP2's default: \
         {base_step:.3} s/step, peak {:.3} GiB (timed steps), {:.3} GiB (whole process).\n",
        num(&first, "params") / 1e6,
        num(&first, "world"),
        num(&first, "tokens_per_rank"),
        first.get("torch").and_then(Value::as_str).unwrap_or("?"),
        base_peak / f64::from(1u32 << 30),
        base_proc / f64::from(1u32 << 30),
    );
    md.push_str(
        "| variant | step / FSDP2 | peak / FSDP2 (timed steps) | peak / FSDP2 (process) | kept between steps / \
         shard | waits | kernels | plumbing |\n|---|---|---|---|---|---|---|---|\n",
    );
    for (i, (name, _, _, _)) in variants.iter().enumerate() {
        let step = med(i, &|v| num(v, "step_s"));
        let split =
            |k: &'static str| med(i, &move |v: &Value| v.get("split").map_or(f64::NAN, |s| num(s, k)));
        let kept = med(i, &|v| num(v, "retained_bytes") / num(v, "shard_bytes"));
        let _ = writeln!(
            md,
            "| {name} | {:.3} | {:.3} | {:.3} | {kept:.2e} | {:.2} | {:.2} | {:.2} |",
            step / base_step,
            med(i, &|v| max_of(v, "peak_bytes")) / base_peak,
            med(i, &|v| max_of(v, "peak_process_bytes")) / base_proc,
            split("waits_s") / step,
            split("kernels_s") / step,
            split("plumbing_s") / step,
        );
    }
    md.push_str(
        "\nwaits, kernels, plumbing: fractions of the variant's own step (the slowest rank's median step): time \
         inside torch.distributed's calls (FSDP2's and zeropp's), inside zeropp's Rust or torch-op kernels, and \
         the rest of zeropp's collectives. Per-round figures: `target/torch-scale/*.json`.\n",
    );
    if !retried.is_empty() {
        let _ = writeln!(
            md,
            "\nRun again after a failure (the figures are the second run's): {}.",
            retried.join("; ")
        );
    }
    let out = report_dir.join("torch-scale.md");
    std::fs::write(&out, &md).map_err(|e| format!("{}: {e}", out.display()))?;
    eprintln!("{md}\n==> wrote {}", out.display());
    Ok(())
}
