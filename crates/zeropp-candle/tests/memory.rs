//! Memory, measured: the peak heap of a thread-backend run of the candle
//! Llama against the engine's memory model (`launch::memory_prediction`), at W =
//! 2, 4, 8, as the native GPT is measured (`zeropp-run/tests/memory.rs`).
//!
//! All ranks run in this process, so the measure is the process's peak of live
//! heap bytes (a counting global allocator), divided by W, against the model's
//! per-rank prediction. The candle stages recompute in backward (the default),
//! so no stage's full weights outlive the engine's gather: the largest
//! allocation stays one gathered layer, far below the full model. This binary
//! holds one test, so no other test allocates meanwhile.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may unwrap: a panic is a test failure

use zeropp_candle::LlamaConfig;
use zeropp_engine::RunConfig;
use zeropp_engine::config::{EngineConfig, ZeroConfig};
use zeropp_engine::data::TextDataset;
use zeropp_engine::launch;
use zeropp_engine::launch::memory_prediction;

/// The counting allocator (live bytes, peak, largest block) of `zeropp_tests::heap`.
#[global_allocator]
static ALLOC: zeropp_tests::heap::Counting = zeropp_tests::heap::Counting;

/// A Llama of 2.5M parameters (d 192, 6 layers, 4 heads, 2 key/value heads),
/// short sequences so the sharded states, not the activations, dominate.
fn shape(vocab: usize) -> LlamaConfig {
    LlamaConfig::shape(vocab, 192, 6, 4, 2, 32)
}

/// Recompute everywhere (`keep_graph(false)`, ZeRO-3's memory), then the
/// default (this model's weights fit `DEFAULT_KEEP_GRAPH_BYTES`: every graph
/// kept), each against the memory model.
#[test]
fn the_candle_llamas_peak_per_rank_is_within_the_memory_model() {
    for keep in [false, true] {
        check(keep);
    }
}

fn check(keep: bool) {
    let vocab = 64;
    let tokens: Vec<u32> =
        (0..40_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 9) % vocab as u32).collect();
    let data = TextDataset::from_tokens(vocab, tokens, 0.1).unwrap();
    let mut previous: Option<(usize, f64, f64)> = None;
    for world in [2, 4, 8] {
        let local = world.min(4);
        let builder = shape(vocab).builder().unwrap();
        let model = if keep { builder } else { builder.keep_graph(false) }.build().unwrap();
        assert_eq!(model.keeps_graph(), keep, "the default keeps this model's graphs");
        let run = RunConfig {
            world,
            local_size: local,
            steps: 2,
            eval_batches: 0,
            engine: EngineConfig {
                zero: ZeroConfig::zeropp(local),
                global_batch: 8,
                ..EngineConfig::default()
            },
            ..RunConfig::default()
        };
        let p = memory_prediction(&model, &run).unwrap();
        let window = zeropp_tests::heap::Window::start();
        let r = launch(&model, &data, &run).unwrap();
        assert!(r.summary.final_loss.is_finite());
        let per_rank = window.peak() as f64 / world as f64;
        let predicted = p.total() as f64;
        let largest = window.largest();
        eprintln!(
            "candle llama ({} params), keep {keep}, W={world}: measured {:.2} MB/rank, predicted {:.2} MB/rank (states {:.2}, \
             gathered layers {:.2}, activations {:.2}), ratio {:.3}; largest allocation {:.2} MB (full f32 model {:.2} MB)",
            shape(vocab).num_params(),
            per_rank / 1e6,
            predicted / 1e6,
            p.states as f64 / 1e6,
            p.transient_layers as f64 / 1e6,
            p.activations as f64 / 1e6,
            per_rank / predicted,
            largest as f64 / 1e6,
            p.full_f32_model as f64 / 1e6,
        );
        assert!(per_rank <= 1.15 * predicted, "keep {keep}, W={world}: {per_rank} > 1.15 x {predicted}");
        assert!(per_rank >= 0.75 * predicted, "keep {keep}, W={world}: {per_rank} < 0.75 x {predicted}");
        assert!(largest < p.full_f32_model / 4, "W={world}: an allocation of {largest} B");
        if let Some((w0, m0, p0)) = previous {
            assert!(per_rank < m0, "W={w0} -> W={world}: the peak per rank did not fall");
            let (measured, model) = (per_rank / m0, predicted / p0);
            assert!(
                (measured / model - 1.0).abs() <= 0.25,
                "W={w0} -> W={world}: {measured:.3} vs {model:.3}"
            );
        }
        previous = Some((world, per_rank, predicted));
    }
}
