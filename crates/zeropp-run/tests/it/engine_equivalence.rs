//! ZeRO-3 with f32 communication on W ranks equals single-rank training, and
//! hpZ without quantization equals plain ZeRO-3 exactly.

use zeropp_engine::RunConfig;
use zeropp_engine::config::{AdamWConfig, CommDtype, EngineConfig, ZeroConfig};
use zeropp_engine::model::{Gpt, GptConfig, Model};
use zeropp_engine::reference::{Summation, train_sequential};
use zeropp_run::train::{TrainConfig, train};

const STEPS: usize = 20;

fn base(world: usize, local: usize, zero: ZeroConfig) -> TrainConfig {
    let engine = EngineConfig {
        zero,
        optim: AdamWConfig { lr: 1e-2, weight_decay: 0.01, ..AdamWConfig::default() },
        global_batch: 16,
        grad_accum: 2,
        gradient_clipping: Some(1.0),
        seed: 7,
    };
    {
        let b = crate::tiny_gpt_run(world, local, engine);
        TrainConfig { run: RunConfig { steps: STEPS, eval_batches: 0, ..b.run }, ..b }
    }
}

/// Single-rank reference: the same global batches, full forward/backward, AdamW.
fn reference(cfg: &TrainConfig) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (model, data, _) = cfg.build().unwrap();
    let r = train_sequential(&model, &data, &cfg.run.engine, cfg.run.steps, Summation::Batch).unwrap();
    (r.losses, r.params)
}

/// Per layer, the flat range of the attention key bias (empty for other layers).
fn key_bias_ranges() -> Vec<std::ops::Range<usize>> {
    let model = Gpt::new(GptConfig::tiny()).unwrap();
    model
        .layers()
        .iter()
        .map(|layer| {
            let offs = layer.offsets();
            layer.params.iter().zip(offs).find(|(p, _)| p.name == "attn.qkv.bias").map_or(0..0, |(p, o)| {
                let d = p.numel() / 3;
                o + d..o + 2 * d
            })
        })
        .collect()
}

fn rel(a: f32, b: f32) -> f32 {
    (a - b).abs() / b.abs().max(1e-3)
}

#[test]
fn zero3_f32_matches_single_rank() {
    let zero = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() };
    let (ref_losses, ref_params) = reference(&base(2, 1, zero));
    for (w, l) in [(2, 1), (2, 2), (4, 2), (4, 4), (8, 4), (8, 2)] {
        let r = train(&base(w, l, zero)).unwrap();
        assert_eq!(r.steps.len(), STEPS);
        for (s, (a, b)) in r.steps.iter().map(|s| s.loss).zip(&ref_losses).enumerate() {
            assert!(rel(a, *b) < 1e-5, "W={w} L={l} step {s}: loss {a} vs reference {b}");
        }
        let params = r.params.unwrap();
        // Relative L2 distance per layer (per-element ratios are ill-conditioned:
        // Adam turns rounding-level differences of near-zero gradients into
        // O(lr) steps on single elements).
        // The attention key bias is excluded: its exact gradient is zero (softmax is
        // shift-invariant), so what both runs compute for it is rounding noise that
        // Adam normalises into lr-sized steps of random sign.
        let skip = key_bias_ranges();
        for (li, (p, q)) in params.iter().zip(&ref_params).enumerate() {
            let keep = |i: &usize| !skip[li].contains(i);
            let p: Vec<f32> = (0..p.len()).filter(keep).map(|i| p[i]).collect();
            let q: Vec<f32> = (0..q.len()).filter(keep).map(|i| q[i]).collect();
            let d: f64 = p.iter().zip(&q).map(|(a, b)| f64::from(a - b).powi(2)).sum::<f64>().sqrt();
            let n: f64 = q.iter().map(|b| f64::from(*b).powi(2)).sum::<f64>().sqrt();
            eprintln!("W={w} L={l} layer {li}: relative L2 distance {:.3e}", d / n);
            assert!(d / n < 1e-5, "W={w} L={l} layer {li}: parameters differ by {} (relative L2)", d / n);
        }
    }
    // The loss fell.
    let head: f32 = ref_losses[..3].iter().sum();
    let tail: f32 = ref_losses[STEPS - 3..].iter().sum();
    assert!(tail < head, "loss did not fall: {ref_losses:?}");
}

#[test]
fn hpz_without_quantization_is_exactly_zero3() {
    for dtype in [CommDtype::Bf16, CommDtype::F32] {
        let z3 = ZeroConfig { comm_dtype: dtype, ..ZeroConfig::zero3() };
        let hpz = ZeroConfig { hpz_size: 4, ..z3 };
        let a = train(&base(8, 4, z3)).unwrap();
        let b = train(&base(8, 4, hpz)).unwrap();
        let la: Vec<u32> = a.steps.iter().map(|s| s.loss.to_bits()).collect();
        let lb: Vec<u32> = b.steps.iter().map(|s| s.loss.to_bits()).collect();
        assert_eq!(la, lb, "{dtype:?}");
        assert_eq!(a.params, b.params, "{dtype:?}");
        // ... while hpZ moved the backward gather off the inter-node links.
        assert_eq!(b.summary.bytes_by_op["bwd_gather"].inter, 0.0);
        assert!(a.summary.bytes_by_op["bwd_gather"].inter > 0.0);
    }
}
