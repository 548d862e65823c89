//! The candle adapter's bench (`cargo xtask bench candle`): where a candle
//! model's step time goes against the native GPT of the same shape, the
//! matmul-thread setting, and ZeRO++ against ZeRO-3 on the candle Llama over
//! seeds.
//!
//! Every figure is a ratio measured in this run:
//!
//! 1. **Step time**, candle Llama / native GPT, at the same width, depth,
//!    heads (the Llama with as many key/value heads as heads) and sequence
//!    length, on one rank and on 2 × 4 ranks (thread backend, ZeRO-3, no link
//!    model): the adapter's cost. The default keeps every stage's graph
//!    here (the model's weights fit `DEFAULT_KEEP_GRAPH_BYTES`); beside it,
//!    the same with every stage recomputed (`keep_graph(false)`, ZeRO-3's
//!    memory), and one stage's forward time split into its matmuls and the
//!    rest.
//! 2. **Matmul threads** at 2 × 4 ranks on this machine's cores: 1 thread per
//!    rank (the default), 2, and candle's own default (its global pool,
//!    RAYON_NUM_THREADS or every core for every rank's matmuls).
//! 3. **Fidelity**: validation loss of ZeRO++ (the defaults) over ZeRO-3 for
//!    the candle Llama on tinyshakespeare, per seed, mean, spread and worst
//!    seed (skipped with a message without `../shared/data`).
//!
//! Writes markdown to `target/bench-report/candle.md`. Knobs:
//! `ZEROPP_BENCH_STEPS` (timed steps, default 20), `ZEROPP_CANDLE_ROUNDS`
//! (alternating step-time rounds, median taken, default 3),
//! `ZEROPP_CANDLE_GLIBC_DEFAULT=1` (glibc's malloc settings, not
//! `alloc::retain_freed_memory`'s), `ZEROPP_CANDLE_SEEDS`
//! (default 5), `ZEROPP_CANDLE_FIDELITY_STEPS` (default 1500; 0 skips it).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark may unwrap

use std::fmt::Write as _;
use std::time::Instant;
use zeropp_engine::RunConfig;

use candle_core::{D, DType, Device, Tensor};
use zeropp_candle::{CandleModel, LlamaConfig};
use zeropp_engine::config::{CommDtype, ZeroConfig};
use zeropp_engine::data::TextDataset;
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::model::{Gpt, GptConfig, Model};
use zeropp_engine::{TrainReport, launch};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The default run (global batch 16) on `world` ranks in nodes of `local`, no validation.
fn cfg(world: usize, local: usize, zero: ZeroConfig, steps: usize) -> RunConfig {
    RunConfig { eval_batches: 0, ..RunConfig::on(world, local).with_zero(zero).with_steps(steps) }
}

/// Mean step time of `model` over `steps` steps (the first 2 dropped).
fn step_time<M: Model>(model: &M, data: &TextDataset, c: &RunConfig) -> f64 {
    let r: TrainReport = launch(model, data, c).unwrap();
    let t: Vec<f64> = r.steps.iter().skip(2).map(|s| s.step_time_s).collect();
    t.iter().sum::<f64>() / t.len() as f64
}

/// Seconds per call of `f`, over at least 10 calls and 0.3 s.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut n = 0u32;
    while n < 10 || start.elapsed().as_secs_f64() < 0.3 {
        f();
        n += 1;
    }
    start.elapsed().as_secs_f64() / f64::from(n)
}

/// One decoder layer's forward on a `[b, t, d]` input, and just its matmuls
/// (the same shapes), in seconds per call.
fn block_split(c: &LlamaConfig, b: usize) -> (f64, f64) {
    let dev = Device::Cpu;
    let (t, d, hd, h, kv, ff) = (c.seq_len, c.d_model, c.head_dim(), c.n_head, c.n_kv_head, c.d_ff);
    let x = Tensor::randn(0f32, 1.0, (b, t, d), &dev).unwrap();
    let model = c.build().unwrap();
    let params = zeropp_engine::model::init_params(&model, 1).unwrap();
    let vb_tensors: std::collections::HashMap<String, Tensor> = model.layers()[1]
        .params
        .iter()
        .scan(0usize, |at, p| {
            let v = Tensor::from_slice(&params[1][*at..*at + p.numel()], p.shape.as_slice(), &dev).unwrap();
            *at += p.numel();
            Some((p.name.clone(), v))
        })
        .collect();
    let full = time(|| {
        let vb = candle_nn::VarBuilder::from_tensors(vb_tensors.clone(), DType::F32, &dev);
        zeropp_candle::llama::block(c, vb, &x).unwrap();
    });
    let w = |o: usize, i: usize| Tensor::randn(0f32, 0.02, (o, i), &dev).unwrap();
    let (wq, wk, wv, wo, wg, wu, wd) =
        (w(h * hd, d), w(kv * hd, d), w(kv * hd, d), w(d, h * hd), w(ff, d), w(ff, d), w(d, ff));
    let q = Tensor::randn(0f32, 1.0, (b, h, t, hd), &dev).unwrap();
    let mm = time(|| {
        let lin = |x: &Tensor, w: &Tensor| x.broadcast_matmul(&w.t().unwrap()).unwrap();
        let _ = (lin(&x, &wq), lin(&x, &wk), lin(&x, &wv));
        let s = q.matmul(&q.t().unwrap()).unwrap();
        let _ = s.matmul(&q).unwrap();
        let y = lin(&x, &wo);
        let g = lin(&y, &wg);
        let _ = lin(&y, &wu);
        let _ = lin(&g, &wd).sum(D::Minus1).unwrap();
    });
    (full, mm)
}

/// The median of `v` (not empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let steps = env_usize("ZEROPP_BENCH_STEPS", 20);
    let rounds = env_usize("ZEROPP_CANDLE_ROUNDS", 3).max(1);
    // As `zeropp train` runs (ZEROPP_CANDLE_GLIBC_DEFAULT=1: glibc's defaults).
    let retained =
        env_usize("ZEROPP_CANDLE_GLIBC_DEFAULT", 0) == 0 && zeropp_candle::alloc::retain_freed_memory();
    let (data, _) = load_data(&DataChoice::Markov { seed: 0, chars: 200_000 }).unwrap();
    let vocab = data.vocab_size();
    let g = GptConfig::default_small().with_vocab(vocab);
    let native = Gpt::new(g).unwrap();
    let shape = LlamaConfig::shape(vocab, g.d_model, g.n_layer, g.n_head, g.n_head, g.seq_len);
    let llama = shape.build().unwrap();
    assert!(llama.keeps_graph(), "the bench model's weights fit the default keep budget");
    let recompute = shape.builder().unwrap().keep_graph(false).build().unwrap();
    let composite = LlamaConfig { fused_ops: false, ..shape }.build().unwrap();
    let z3 = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() };
    let mut md = String::from("# bench `candle`\n\n");
    let _ = writeln!(
        md,
        "Native GPT (d {}, {} layers, {} heads, seq {}, MLP 4d: {} params) and the candle Llama of the same width, \
         depth, heads (as many key/value heads) and seq (SwiGLU {}: {} params); ZeRO-3 at f32, thread backend, \
         no link model, {} timed steps, global batch 16, median of {} alternating rounds, freed memory retained \
         (`alloc::retain_freed_memory`): {}. Ratios within this run.\n",
        g.d_model,
        g.n_layer,
        g.n_head,
        g.seq_len,
        native.num_params(),
        shape.d_ff,
        shape.num_params(),
        steps,
        rounds,
        retained
    );
    let _ = writeln!(
        md,
        "## Step time\n\n| ranks | native GPT (s) | candle Llama (s) | Llama / GPT | Llama recomputing / GPT | \
         default / recompute | fused ops / composite |\n|---|---|---|---|---|---|---|"
    );
    for (w, l) in [(1, 1), (8, 4)] {
        let c = cfg(w, l, z3, steps);
        // Alternating rounds, the median of each: this machine's noise moves
        // one run by 20%.
        let mut runs: [Vec<f64>; 4] = Default::default();
        for _ in 0..rounds {
            runs[0].push(step_time(&native, &data, &c));
            runs[1].push(step_time(&llama, &data, &c));
            runs[2].push(step_time(&recompute, &data, &c));
            runs[3].push(step_time(&composite, &data, &c));
        }
        let [tn, tc, tk, tx] = runs.map(median);
        let _ = writeln!(
            md,
            "| {w} = {}x{l} | {tn:.4} | {tc:.4} | {:.2}x | {:.2}x | {:.2} | {:.2} |",
            w / l,
            tc / tn,
            tk / tn,
            tc / tk,
            tc / tx
        );
        eprintln!(
            "candle bench: {w} ranks: GPT {tn:.4} s, Llama {tc:.4} s, recomputing {tk:.4} s, composite ops {tx:.4} s"
        );
    }
    let (full, mm) = block_split(&shape, 2);
    let _ = writeln!(
        md,
        "\nOne decoder layer's forward (micro-batch 2, one thread): its matmuls take {:.0}% of it; the rest is \
         candle's element-wise ops, reshapes and copies (RMSNorm, RoPE, the attention kernel, SwiGLU's product, \
         residual adds). A backward by recompute runs the forward again and then candle's autograd.\n",
        100.0 * mm / full
    );

    let _ = writeln!(
        md,
        "## Matmul threads per rank (8 ranks = 2x4 on {} cores)\n\n| setting | step time (s) | vs 1 thread |\n|---|---|---|",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let c = cfg(8, 4, z3, steps);
    let one = step_time(&llama, &data, &c);
    let two = step_time(&shape.builder().unwrap().matmul_threads(2).build().unwrap(), &data, &c);
    let own = step_time(&shape.builder().unwrap().matmul_threads(0).build().unwrap(), &data, &c);
    let _ = writeln!(
        md,
        "| 1 thread (default) | {one:.4} | 1.00 |\n| 2 threads | {two:.4} | {:.2} |\n| candle's own (all cores, every rank) | {own:.4} | {:.2} |",
        two / one,
        own / one
    );
    eprintln!("candle bench: matmul threads 1 {one:.4} s, 2 {two:.4} s, candle's own {own:.4} s");

    let fid_steps = env_usize("ZEROPP_CANDLE_FIDELITY_STEPS", 1500);
    let seeds = env_usize("ZEROPP_CANDLE_SEEDS", 5);
    match zeropp_tests::data::find(zeropp_tests::data::TINYSHAKESPEARE) {
        Some(path) if fid_steps > 0 => {
            let (shake, _) = load_data(&DataChoice::File(path)).unwrap();
            let model: CandleModel = LlamaConfig::small(shake.vocab_size()).build().unwrap();
            let mut ratios = Vec::new();
            let mut rows = String::new();
            for seed in 1..=seeds as u64 {
                let val = |zero: ZeroConfig| -> f64 {
                    let mut c = cfg(8, 4, zero, fid_steps);
                    c.eval_batches = 16;
                    c.engine.seed = seed;
                    f64::from(launch(&model, &shake, &c).unwrap().summary.val_loss.unwrap())
                };
                let (a, b) = (val(ZeroConfig::zero3()), val(ZeroConfig::zeropp(4)));
                eprintln!(
                    "candle bench: llama seed {seed}: ZeRO-3 {a:.4}, ZeRO++ {b:.4}, ratio {:.4}",
                    b / a
                );
                let _ = writeln!(rows, "| {seed} | {a:.4} | {b:.4} | {:.4} |", b / a);
                ratios.push(b / a);
            }
            let n = ratios.len() as f64;
            let mean = ratios.iter().sum::<f64>() / n;
            let sd = (ratios.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt();
            let worst = ratios.iter().cloned().fold(f64::MIN, f64::max);
            let best = ratios.iter().cloned().fold(f64::MAX, f64::min);
            let _ = writeln!(
                md,
                "\n## ZeRO++ / ZeRO-3 validation loss, candle Llama (d 64, 2 layers, 4 heads, 2 kv heads, seq 64), \
                 tinyshakespeare, 2x4 ranks, {fid_steps} steps, lr 1e-2\n\nmean {mean:.4} (standard error \
                 {:.4}), worst seed {worst:.4}, spread {best:.4}-{worst:.4}\n\n| seed | ZeRO-3 | ZeRO++ | ratio |\n|---|---|---|---|\n{rows}",
                sd / n.sqrt()
            );
        }
        _ => {
            eprintln!("candle bench: fidelity skipped (no ../shared/data/tinyshakespeare.txt, or 0 steps)");
            md.push_str("\n(fidelity skipped: no ../shared/data/tinyshakespeare.txt)\n");
        }
    }
    print!("{md}");
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/bench-report/candle.md");
    if let Some(dir) = out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&out, md).unwrap();
    eprintln!("candle bench: wrote {}", out.display());
}
