//! The stage-by-stage forward and backward (recomputing, or keeping the graph)
//! equal one whole-graph `loss.backward()`, and finite differences.

use candle_nn::Module;
use zeropp_candle::{CandleModel, LlamaConfig};
use zeropp_engine::model::{Model, full_forward, full_forward_backward, init_params};

use crate::{batch, tiny_llama};

/// Worst relative difference (against the larger magnitude, floored at `floor`).
fn worst_rel(a: &[f32], b: &[f32], floor: f32) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / x.abs().max(y.abs()).max(floor)).fold(0.0, f32::max)
}

#[test]
fn stage_by_stage_equals_one_graph() {
    // Budgets: recompute everything, keep one decoder layer (plus the norm and
    // head, which hold few bytes), keep everything.
    let layer_bytes = 4 * (2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 48 + 2 * 16);
    for (budget, kept) in [(0, 4..5), (layer_bytes + 4 * 16, 2..5), (usize::MAX, 0..5)] {
        let model = LlamaConfig::shape(24, 16, 2, 4, 2, 8)
            .builder()
            .unwrap()
            .keep_graph_bytes(budget)
            .build()
            .unwrap();
        assert_eq!(model.kept_stages(), kept, "budget {budget}");
        let keep = budget;
        let params = init_params(&model, 5).unwrap();
        let b = batch(24, 3, 8, 1);
        let (loss, grads) = full_forward_backward(&model, &params, &b).unwrap();
        let (ref_loss, ref_grads) = model.reference_gradients(&params, &b).unwrap();
        assert_eq!(loss.to_bits(), ref_loss.to_bits(), "keep_graph {keep}: the loss");
        for (l, (g, r)) in grads.iter().zip(&ref_grads).enumerate() {
            let w = worst_rel(g, r, 1e-6);
            assert!(w <= 1e-6, "keep_graph {keep}, stage {l}: relative difference {w}");
        }
    }
}

/// Central differences of the stage-by-stage loss against the backward's
/// gradient, on a tiny model, at the largest gradients of every stage.
#[test]
fn gradients_match_finite_differences() {
    let (vocab, d) = (12, 6);
    let model = CandleModel::builder("fd", vocab, 5)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        .stage("block", move |vb, x| {
            let h = candle_nn::linear(d, 2 * d, vb.pp("up"))?.forward(x)?.tanh()?;
            x + candle_nn::linear(2 * d, d, vb.pp("down"))?.forward(&h)?
        })
        .stage("norm", move |vb, x| zeropp_candle::llama::rms_norm(x, &vb.get(d, "weight")?.exp()?, 1e-5))
        .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
        .build()
        .unwrap();
    let mut params = init_params(&model, 3).unwrap();
    let b = batch(vocab, 2, 5, 9);
    let (_, grads) = full_forward_backward(&model, &params, &b).unwrap();
    let eps = 1e-2f32;
    for l in 0..params.len() {
        // The three largest gradient entries of the stage.
        let mut idx: Vec<usize> = (0..grads[l].len()).collect();
        idx.sort_by(|&i, &j| grads[l][j].abs().total_cmp(&grads[l][i].abs()));
        for &i in idx.iter().take(3) {
            let x0 = params[l][i];
            params[l][i] = x0 + eps;
            let up = full_forward(&model, &params, &b).unwrap().0;
            params[l][i] = x0 - eps;
            let down = full_forward(&model, &params, &b).unwrap().0;
            params[l][i] = x0;
            let fd = (up - down) / (2.0 * eps);
            let g = grads[l][i];
            assert!(
                (fd - g).abs() <= 0.03 * g.abs() + 2e-4,
                "stage {l} [{i}]: backward {g}, differences {fd}"
            );
        }
    }
}

#[test]
fn the_tape_keeps_no_weights_and_calls_come_in_order() {
    let model = tiny_llama(20);
    let params = init_params(&model, 1).unwrap();
    let b = batch(20, 2, 8, 3);
    let mut tape = model.start(&b).unwrap();
    assert!(model.backward(0, &params[0], &mut tape, &mut vec![0.0; params[0].len()]).is_err());
    model.forward(0, &params[0], &mut tape).unwrap();
    assert!(model.forward(2, &params[2], &mut tape).is_err(), "layer 1 is next");
    assert!(model.loss(&tape).is_nan(), "no loss before the last forward");
}

/// The Llama on candle-nn's fused kernels (through zeropp's ops) gives the
/// loss and gradients of its composite-op form.
#[test]
fn the_fused_llama_equals_its_composite_form() {
    let c = LlamaConfig::shape(24, 16, 2, 4, 2, 8);
    let fused = c.build().unwrap();
    let composite = LlamaConfig { fused_ops: false, ..c }.build().unwrap();
    let params = init_params(&fused, 2).unwrap();
    let b = batch(24, 3, 8, 4);
    let (la, ga) = full_forward_backward(&fused, &params, &b).unwrap();
    let (lb, gb) = full_forward_backward(&composite, &params, &b).unwrap();
    assert!((la - lb).abs() <= 1e-6 * lb.abs(), "{la} vs {lb}");
    for (l, (a, r)) in ga.iter().zip(&gb).enumerate() {
        let scale = r.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        let w = a.iter().zip(r).map(|(x, y)| (x - y).abs() / scale).fold(0.0, f32::max);
        assert!(w <= 1e-5, "stage {l}: fused and composite gradients differ by {w} of the largest");
    }
}
