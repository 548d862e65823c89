//! Memory, measured: the peak heap of a thread-backend run against the memory
//! model (`engine::memory::predict`), on a mid-size GPT at W = 2, 4, 8.
//!
//! All ranks run in this process, so the measure is the process's peak of live
//! heap bytes (a counting global allocator), divided by W (the ranks are
//! symmetric), against the model's per-rank prediction. This binary holds one
//! test, so no other test allocates meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap: a panic is a test failure

use zeropp_comm::Topology;
use zeropp_engine::RunConfig;
use zeropp_engine::config::{EngineConfig, ZeroConfig};
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::engine::{build_plan, memory::predict};
use zeropp_engine::model::{Gpt, GptConfig};
use zeropp_run::train::{ModelChoice, TrainConfig, train};

/// The counting allocator (live bytes, peak, largest block) of `zeropp_tests::heap`.
#[global_allocator]
static ALLOC: zeropp_tests::heap::Counting = zeropp_tests::heap::Counting;

/// A mid-size GPT: 8 blocks of width 192 (3.6M parameters), short sequences so
/// the sharded states, not the activations, dominate.
fn shape() -> GptConfig {
    GptConfig { vocab: 256, seq_len: 32, d_model: 192, n_head: 4, n_layer: 8, mlp_ratio: 4 }
}

struct Measured {
    world: usize,
    per_rank: f64,
    predicted: f64,
    states: f64,
    loco: f64,
    delta: f64,
    largest_alloc: usize,
    largest_layer: usize,
    full_f32: usize,
}

fn measure(world: usize, zero: fn(usize) -> ZeroConfig) -> Measured {
    let local = world.min(4);
    let data = DataChoice::Markov { seed: 3, chars: 20_000 };
    let engine =
        EngineConfig { zero: zero(local), global_batch: 8, grad_accum: 1, ..EngineConfig::default() };
    let cfg = TrainConfig {
        model: ModelChoice::Gpt(shape()),
        data: data.clone(),
        run: RunConfig {
            world,
            local_size: local,
            engine: engine.clone(),
            steps: 2,
            eval_batches: 0,
            ..RunConfig::default()
        },
    };
    // The model as training builds it (the data's vocabulary).
    let vocab = load_data(&data).unwrap().0.vocab_size();
    let model = Gpt::new(shape().with_vocab(vocab)).unwrap();
    let plan = build_plan(&model, &engine, Topology::ranks(world).per_node(local).unwrap()).unwrap();
    let p = predict(&model, &plan, &engine, engine.micro_batch(world).unwrap()).unwrap();

    let window = zeropp_tests::heap::Window::start();
    let report = train(&cfg).unwrap();
    assert!(report.summary.final_loss.is_finite());
    let peak = window.peak();
    Measured {
        world,
        per_rank: peak as f64 / world as f64,
        predicted: p.total() as f64,
        states: p.states as f64,
        loco: p.error_feedback as f64,
        delta: p.delta_copy as f64,
        largest_alloc: window.largest(),
        largest_layer: 4 * plan.buckets().iter().map(|b| b.padded_len).max().unwrap_or(0),
        full_f32: p.full_f32_model,
    }
}

#[test]
fn measured_peak_per_rank_is_within_the_memory_model() {
    // ZeRO++ as configured by default, the paper's plain ZeRO++, and ZeRO++ with
    // SDP4Bit's techniques (the hpZ copy held across steps, and Ŵ).
    let mut runs = Vec::new();
    for zero in
        [ZeroConfig::zeropp as fn(usize) -> ZeroConfig, ZeroConfig::zeropp_plain, ZeroConfig::zeropp_delta]
    {
        let r = [2, 4, 8].into_iter().map(|w| measure(w, zero)).collect::<Vec<_>>();
        check(&r);
        runs.push(r);
    }
    // What qwZ-Δ adds to the default ZeRO++ is its Ŵ (a bf16 copy of the
    // primary shards), as the model says: within a factor 2 either way where Ŵ
    // is at least 3 MB a rank (W = 2). The peak of W ranks' threads on a few
    // cores moves with how their phases line up (qwZ-Δ's forward waits on no
    // other node, so they line up differently), by about 1 MB a rank between
    // two runs of the same configuration at W = 4: there (Ŵ 1.8 MB a rank) CI
    // once measured 0.6 MB of difference, and at W = 8 (Ŵ 0.9 MB) runs here
    // measured 2.0 to 3.0 MB. Below 3 MB the figure is printed, not bounded
    // (each run is still held to the memory model above).
    for (base, delta) in runs[0].iter().zip(&runs[2]) {
        let extra = delta.per_rank - base.per_rank;
        if delta.delta < 3e6 {
            eprintln!(
                "W={}: qwZ-delta adds {extra:.0} B per rank, the model {:.0} B (below the noise; not bounded)",
                base.world, delta.delta
            );
            continue;
        }
        assert!(
            (0.5 * delta.delta..=2.0 * delta.delta).contains(&extra),
            "W={}: qwZ-delta adds {extra:.0} B per rank, the model {:.0} B",
            base.world,
            delta.delta
        );
    }
}

fn check(runs: &[Measured]) {
    for m in runs {
        eprintln!(
            "W={}: measured {:.1} MB/rank, predicted {:.1} MB/rank (states {:.1} MB, LoCo {:.1} MB, Ŵ {:.1} MB), ratio {:.3}; \
             largest allocation {:.1} MB (largest f32 layer {:.1} MB, full f32 model {:.1} MB)",
            m.world,
            m.per_rank / 1e6,
            m.predicted / 1e6,
            m.states / 1e6,
            m.loco / 1e6,
            m.delta / 1e6,
            m.per_rank / m.predicted,
            m.largest_alloc as f64 / 1e6,
            m.largest_layer as f64 / 1e6,
            m.full_f32 as f64 / 1e6
        );
        assert!(m.per_rank <= 1.15 * m.predicted, "W={}: {} > 1.15 x {}", m.world, m.per_rank, m.predicted);
        // No buffer the size of the full f32 model (let alone the full optimizer
        // state) is ever allocated: the largest is one gathered layer.
        assert!(m.largest_alloc <= m.largest_layer + 4096, "W={}: {} B", m.world, m.largest_alloc);
        assert!(m.largest_alloc < m.full_f32 / 4);
    }
    // The peak per rank falls with W, as the model says.
    for pair in runs.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(b.per_rank < a.per_rank, "W={} -> W={}", a.world, b.world);
        let (measured, predicted) = (b.per_rank / a.per_rank, b.predicted / a.predicted);
        assert!(
            (measured / predicted - 1.0).abs() <= 0.25,
            "W={} -> W={}: measured ratio {measured:.3}, predicted {predicted:.3}",
            a.world,
            b.world
        );
    }
}
