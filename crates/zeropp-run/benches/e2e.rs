//! End-to-end benchmark: ZeRO-3 vs ZeRO++ on the default model (GPT
//! default_small, 8 ranks = 2 nodes x 4) under a slow link model (communication
//! dominates ZeRO-3's step) and a fast one, the single-technique ablation, the
//! engine's overhead, and the full-size fidelity run on tinyshakespeare.
//!
//! Prints a markdown report and writes it to `target/bench-report/e2e.md`.
//! Every figure is a ratio measured in this run. Environment knobs:
//! `ZEROPP_BENCH_STEPS` (timed steps per run, default 12),
//! `ZEROPP_BENCH_FIDELITY_STEPS` (default 300; 0 skips the fidelity run).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark may unwrap

use std::path::PathBuf;
use std::time::Instant;
use zeropp_engine::RunConfig;

use zeropp_engine::config::{AdamWConfig, EngineConfig, ZeroConfig};
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::model::{GptConfig, Model, full_forward_backward, init_params};
use zeropp_engine::optim::AdamW;
use zeropp_run::compare::{Comparison, Variant, compare, standard_variants};
use zeropp_run::train::{ModelChoice, TrainConfig, train};

const SLOW: &str = "intra=200MB/s,inter=5MB/s,latency=20us";
const FAST: &str = "intra=100GB/s,inter=25GB/s,latency=2us";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn base(steps: usize) -> TrainConfig {
    TrainConfig {
        run: RunConfig { steps, eval_batches: 0, ..RunConfig::default() },
        ..TrainConfig::default()
    }
}

/// The bench's table: each variant against the comparison's baseline
/// (the CLI's `zeropp compare` prints the full table, flat ZeRO-3 beside it).
fn table(cmp: &Comparison) -> String {
    let base = cmp.baseline().map_or("baseline", |b| b.variant.name.as_str());
    let mut s = format!(
        "| variant | routing | final loss | val loss | step time (s) | speedup vs {base} \
         | inter-node MB/rank/step | inter-node vs {base} |\n|---|---|---|---|---|---|---|---|\n"
    );
    for r in &cmp.results {
        let (sm, q) = (&r.report.summary, cmp.ratios(r).baseline);
        let val = sm.val_loss.map_or_else(|| "-".into(), |v| format!("{v:.4}"));
        s.push_str(&format!(
            "| {} | {} | {:.4} | {val} | {:.4} | {:.2}x | {:.3} | {:.3}x |\n",
            r.variant.name,
            r.variant.zero.routing.name(),
            sm.final_loss,
            sm.mean_step_time_s,
            q.speedup,
            sm.bytes_per_step.inter / 1e6,
            q.inter_bytes
        ));
    }
    s
}

fn main() {
    let steps = env_usize("ZEROPP_BENCH_STEPS", 12);
    let mut md = String::from("# zeropp e2e benchmark\n\n");
    md.push_str(&format!(
        "Default model (GPT default_small), generated Markov text, 8 ranks = 2 nodes x 4, global batch 16, {steps} steps per run (first step excluded from times). Bytes are per rank per step.\n\n"
    ));

    for (name, link) in [("slow (communication-bound)", SLOW), ("fast", FAST)] {
        let mut cfg = base(steps);
        cfg.run.link = Some(link.parse().unwrap());
        let variants: Vec<Variant> = standard_variants(&ZeroConfig::zero3(), cfg.run.local_size);
        let cmp = compare(&cfg, &variants, &mut |_, _| {}).unwrap();
        md.push_str(&format!("## Link model {name}: `{link}`\n\n"));
        md.push_str(&table(&cmp));
        md.push('\n');
    }

    // Engine overhead: compute-only (the model's forward/backward + AdamW on one
    // thread, no engine, no communication) vs ZeRO-3 on 8 ranks with no link model.
    let cfg = base(steps);
    let (data, _) = load_data(&cfg.data).unwrap();
    let model =
        zeropp_engine::model::Gpt::new(GptConfig::default_small().with_vocab(data.vocab_size())).unwrap();
    let mut params = init_params(&model, 0).unwrap();
    let mut opts: Vec<AdamW> = params.iter().map(|p| AdamW::new(AdamWConfig::default(), p.len())).collect();
    let mut times = Vec::new();
    for step in 0..steps {
        let t0 = Instant::now();
        let b = data.global_batch(step as u64, 0, 16, model.seq_len(), 0).unwrap();
        let (_, g) = full_forward_backward(&model, &params, &b).unwrap();
        for ((p, g), o) in params.iter_mut().zip(&g).zip(&mut opts) {
            o.step(p, g, 1.0).unwrap();
        }
        times.push(t0.elapsed().as_secs_f64());
    }
    let compute = times[1..].iter().sum::<f64>() / (times.len() - 1).max(1) as f64;
    let z3 = train(&{
        let b = cfg.clone();
        TrainConfig {
            run: RunConfig {
                engine: EngineConfig { zero: ZeroConfig::zero3(), ..cfg.run.engine.clone() },
                ..b.run
            },
            ..b
        }
    })
    .unwrap();
    let w1 = train(&{
        let b = cfg.clone();
        TrainConfig {
            run: RunConfig {
                world: 1,
                local_size: 1,
                engine: EngineConfig { zero: ZeroConfig::zero3(), ..cfg.run.engine.clone() },
                ..b.run
            },
            ..b
        }
    })
    .unwrap();
    md.push_str("## Engine overhead (no link model)\n\n| run | step time / compute-only |\n|---|---|\n");
    md.push_str("| compute only (model fwd/bwd + AdamW, one thread, global batch 16) | 1.00 |\n");
    md.push_str(&format!(
        "| ZeRO-3 engine, 1 rank (no communication) | {:.2} |\n",
        w1.summary.mean_step_time_s / compute
    ));
    md.push_str(&format!(
        "| ZeRO-3 engine, 8 ranks = 2 x 4 threads | {:.2} |\n\n",
        z3.summary.mean_step_time_s / compute
    ));
    md.push_str(&format!(
        "(host: {} logical CPUs; 8 rank threads share them, so the 8-rank figure includes oversubscription)\n\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));

    // Full-size fidelity: ZeRO++ vs ZeRO-3 (bf16) on tinyshakespeare.
    let fsteps = env_usize("ZEROPP_BENCH_FIDELITY_STEPS", 300);
    let shakespeare = zeropp_tests::data::find(zeropp_tests::data::TINYSHAKESPEARE);
    if fsteps > 0
        && let Some(shakespeare) = shakespeare
    {
        let f = TrainConfig {
            model: ModelChoice::Gpt(GptConfig::default_small()),
            data: DataChoice::File(shakespeare),
            run: RunConfig {
                steps: fsteps,
                eval_batches: 16,
                engine: EngineConfig {
                    optim: AdamWConfig { lr: 1e-2, ..AdamWConfig::default() },
                    ..TrainConfig::default().run.engine
                },
                ..RunConfig::default()
            },
        };
        let variants = vec![
            Variant { name: "zero3".into(), zero: ZeroConfig::zero3() },
            Variant { name: "zeropp".into(), zero: ZeroConfig::zeropp(4) },
        ];
        let cmp = compare(&f, &variants, &mut |_, _| {}).unwrap();
        md.push_str(&format!(
            "## Fidelity: GPT default_small on tinyshakespeare, {fsteps} steps, no link model\n\n"
        ));
        md.push_str(&table(&cmp));
        let (a, b) = (cmp.results[0].report.summary.val_loss, cmp.results[1].report.summary.val_loss);
        if let (Some(a), Some(b)) = (a, b) {
            md.push_str(&format!("\nval loss ZeRO++ / ZeRO-3 = {:.4}\n", b / a));
        }
    } else {
        md.push_str("## Fidelity: skipped (tinyshakespeare absent or ZEROPP_BENCH_FIDELITY_STEPS=0)\n");
    }

    print!("{md}");
    let out = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-report");
    if std::fs::create_dir_all(&out).is_ok() {
        let path = out.join("e2e.md");
        if std::fs::write(&path, &md).is_ok() {
            eprintln!("wrote {}", path.display());
        }
    }
}
