//! One row of the scale bench (`cargo xtask bench scale`): trains a GPT preset
//! for a few steps with the thread backend and prints one JSON object with what
//! the run measured — tokens/s, the step-time split, bytes against the analytic
//! model, the memory model against this process's peak RSS (`VmHWM`) — or, with
//! `--gemm`, the GEMM rate of the model's largest linear shapes.
//!
//! ```text
//! cargo run --release -p zeropp-engine --example scale -- \
//!     --model gpt2-small --seq 256 [--world 8] [--local 4] [--steps 3] [--mode zero3|zeropp] [--batch 8]
//! cargo run --release -p zeropp-engine --example scale -- --model gpt2-small --seq 256 --gemm
//! ```
//!
//! One size per process, so the peak RSS is that size's.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench driver: failures abort

use std::time::Instant;
use zeropp_engine::RunConfig;

use zeropp_comm::Topology;
use zeropp_engine::config::{EngineConfig, ZeroConfig};
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::engine::{build_plan, memory::predict};
use zeropp_engine::model::gemm::{Trans, matmul};
use zeropp_engine::model::{Gpt, GptConfig};
use zeropp_run::train::{ModelChoice, TrainConfig, train};

fn arg(args: &[String], key: &str) -> Option<String> {
    args.iter().position(|a| a == key).and_then(|i| args.get(i + 1)).cloned()
}

fn num(args: &[String], key: &str, default: usize) -> usize {
    arg(args, key).map_or(default, |v| v.parse().unwrap_or_else(|_| panic!("{key}: not a number: {v}")))
}

/// GFLOP/s of `C = A·B` (`m x k` by `k x n`, row-major f32) through the engine's GEMM,
/// from the fastest of several calls.
fn gemm_rate(m: usize, k: usize, n: usize) -> f64 {
    let a: Vec<f32> = (0..m * k).map(|i| ((i % 17) as f32 - 8.0) * 0.01).collect();
    let b: Vec<f32> = (0..k * n).map(|i| ((i % 13) as f32 - 6.0) * 0.01).collect();
    let mut c = vec![0.0f32; m * n];
    matmul(Trans::No, Trans::No, m, k, n, &a, &b, 0.0, &mut c).unwrap(); // warm-up
    let flops = 2.0 * (m * k * n) as f64;
    // The fastest of several calls: robust to a loaded machine.
    let reps = ((1e10 / flops) as usize).clamp(5, 30);
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        matmul(Trans::No, Trans::No, m, k, n, std::hint::black_box(&a), &b, 0.0, &mut c).unwrap();
        std::hint::black_box(&mut c);
        best = best.min(t.elapsed().as_secs_f64());
    }
    flops / best / 1e9
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = arg(&args, "--model").unwrap_or_else(|| "gpt-1m".into());
    let mut g = GptConfig::preset(&name).unwrap_or_else(|| panic!("unknown preset {name}"));
    g.seq_len = num(&args, "--seq", g.seq_len);
    let (world, local) = (num(&args, "--world", 8), num(&args, "--local", 4));
    let batch = num(&args, "--batch", 8);
    let data = DataChoice::Markov { seed: 1, chars: 200_000 };
    let vocab = load_data(&data).unwrap().0.vocab_size();
    let model = Gpt::new(g.with_vocab(vocab)).unwrap();
    let params = model.num_params();
    if args.iter().any(|a| a == "--gemm") {
        // The largest linear shapes of a step, at the rows one rank computes.
        let rows = batch / world.max(1) * g.seq_len;
        let (d, f) = (g.d_model, g.mlp_ratio * g.d_model);
        let shapes = [(rows, d, f), (rows, f, d), (rows, d, 3 * d)];
        let rates: Vec<String> = shapes
            .iter()
            .map(|&(m, k, n)| {
                format!("{{\"m\":{m},\"k\":{k},\"n\":{n},\"gflops\":{:.3}}}", gemm_rate(m, k, n))
            })
            .collect();
        println!("{{\"model\":\"{name}\",\"params\":{params},\"gemm\":[{}]}}", rates.join(","));
        return;
    }
    let steps = num(&args, "--steps", 3);
    let zero = match arg(&args, "--mode").as_deref() {
        Some("zero3") => ZeroConfig::zero3(),
        _ => ZeroConfig::zeropp(local),
    };
    let engine = EngineConfig { zero, global_batch: batch, ..EngineConfig::default() };
    let topo = Topology::ranks(world).per_node(local).unwrap();
    let plan = build_plan(&model, &engine, topo).unwrap();
    let mem = predict(&model, &plan, &engine, engine.micro_batch(world).unwrap()).unwrap();
    let cfg = TrainConfig {
        model: ModelChoice::Gpt(g),
        data,
        run: RunConfig { world, local_size: local, engine, steps, eval_batches: 0, ..RunConfig::default() },
    };
    let t0 = Instant::now();
    let r = train(&cfg).unwrap();
    let wall = t0.elapsed().as_secs_f64();
    // Steady state: the steps after the first (the first also faults in the buffers).
    let timed: Vec<_> = if r.steps.len() > 1 { r.steps[1..].to_vec() } else { r.steps.clone() };
    let k = timed.len().max(1) as f64;
    let mean = |f: &dyn Fn(&zeropp_engine::metrics::StepRecord) -> f64| timed.iter().map(f).sum::<f64>() / k;
    let s = &r.summary;
    let exact = s.bytes_by_op == s.model_bytes_by_op
        && r.steps.iter().all(|rec| rec.bytes_by_op == s.model_bytes_by_op);
    println!(
        "{{\"model\":\"{name}\",\"params\":{params},\"seq\":{},\"world\":{world},\"local\":{local},\"mode\":\"{}\",\
         \"steps\":{steps},\"step_s\":{:.4},\"tokens_per_s\":{:.1},\"compute_s\":{:.4},\"comm_s\":{:.4},\"quant_s\":{:.4},\"optim_s\":{:.4},\
         \"inter_bytes\":{:.0},\"intra_bytes\":{:.0},\"model_inter_bytes\":{:.0},\"bytes_exact\":{exact},\
         \"predicted_rank_bytes\":{},\"predicted_states_bytes\":{},\"peak_rss_bytes\":{},\"wall_s\":{wall:.2},\"final_loss\":{:.4}}}",
        g.seq_len,
        s.mode,
        mean(&|r| r.step_time_s),
        mean(&|r| r.tokens_per_s),
        mean(&|r| r.times.compute_s),
        mean(&|r| r.times.comm_s),
        mean(&|r| r.times.quant_s),
        mean(&|r| r.times.optim_s),
        s.bytes_per_step.inter,
        s.bytes_per_step.intra,
        s.model_bytes_per_step.inter,
        mem.total(),
        mem.states,
        zeropp_engine::engine::memory::peak_rss().unwrap_or(0),
        s.final_loss,
    );
}
