//! The build-time gradient check at real widths (issue 38 §2): its power
//! must not fall with size, and it must not raise false alarms.
//!
//! The seeded defects are the issue's: a weight used twice, `x + x·Wᵀ +
//! a·tanh(x·Wᵀ)`, with the tanh use cut (`detach`), so every element gets a
//! gradient but a wrong one. With `a = 1` the cut use carries about half of the
//! directional derivative; with `a = 0.12` about a tenth. The f32 check of
//! earlier releases caught the first at d 8, seq 4 only, and neither at d 64 ×
//! seq 64 or beyond.

use candle_core::Tensor;
use candle_nn::Module;
use zeropp_candle::{CandleError, CandleModel, LlamaConfig};

/// A three-stage model whose middle stage is `x + x·Wᵀ + a·f(x·Wᵀ)`, `f` tanh
/// or (`linear`) the identity, the `f` use cut when `cut`, at width `d` and
/// sequence `seq`. With the identity the cut use carries exactly `a / (1 + a)`
/// of W's gradient (tanh saturates at width, so its share falls with size).
fn two_uses(d: usize, seq: usize, a: f64, cut: bool, linear: bool) -> Result<CandleModel, CandleError> {
    let vocab = 16;
    CandleModel::builder("two-uses", vocab, seq)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        .stage("mix", move |vb, x| {
            let w = vb.get((d, d), "w")?;
            let h = x.broadcast_matmul(&w.t()?)?;
            let side = if cut { h.detach() } else { h.clone() };
            let side = if linear { side } else { side.tanh()? };
            (x + &h)? + (side * a)?
        })
        .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
        .build()
}

fn assert_caught(r: Result<CandleModel, CandleError>, what: &str) {
    match r {
        Err(CandleError::WrongGradient { stage, param, backward, differences }) => {
            assert_eq!((stage.as_str(), param.as_str()), ("mix", "w"), "{what}");
            let gap = (backward - differences).abs() / differences.abs().max(backward.abs());
            eprintln!("{what}: backward {backward:.6e}, differences {differences:.6e}, gap {gap:.3}");
        }
        Err(e) => panic!("{what}: expected WrongGradient, got {e}"),
        Ok(_) => panic!("{what}: the cut use was not caught"),
    }
}

/// The share of W's directional derivative `0.1 / 0.9` of `a` cuts:
/// `a / (1 + a) = 0.1`.
const TENTH: f64 = 1.0 / 9.0;

/// Caught at the size, d 512 × seq 256: the tanh use cut, and a
/// use carrying exactly a tenth of the derivative cut; the uncut models build.
#[test]
fn a_cut_use_is_caught_at_d512_seq256() {
    assert_caught(two_uses(512, 256, 1.0, true, false), "d 512, seq 256, the tanh use cut");
    assert_caught(two_uses(512, 256, TENTH, true, true), "d 512, seq 256, a tenth cut");
    two_uses(512, 256, 1.0, false, false).unwrap();
    two_uses(512, 256, TENTH, false, true).unwrap();
}

/// And at the sizes in between, where the f32 check went blind.
#[test]
fn a_cut_use_is_caught_at_every_width() {
    for (d, seq) in [(8, 4), (16, 16), (64, 64), (128, 128)] {
        assert_caught(two_uses(d, seq, TENTH, true, true), &format!("d {d}, seq {seq}, a tenth cut"));
        assert_caught(two_uses(d, seq, 1.0, true, false), &format!("d {d}, seq {seq}, the tanh use cut"));
        two_uses(d, seq, TENTH, false, true).unwrap();
        two_uses(d, seq, 1.0, false, false).unwrap();
    }
}

/// A path only training takes is checked in training mode (its dropout masks
/// fixed): a weight whose training-only use is cut fails, though evaluation
/// alone is right; with the use intact, and with dropout, the model builds.
#[test]
fn a_training_only_path_is_checked_with_its_masks_fixed() {
    let (vocab, d) = (16, 32);
    let model = |cut: bool| {
        CandleModel::builder("train-only", vocab, 8)
            .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
            .stage_with("mix", move |vb, x, ctx| {
                let w = vb.get((d, d), "w")?;
                let h = ctx.dropout(&x.broadcast_matmul(&w.t()?)?, 0.25)?;
                if ctx.is_train() {
                    let side = if cut { h.detach() } else { h.clone() };
                    (x + &h)? + (side.tanh()? * 0.5)?
                } else {
                    x + h
                }
            })
            .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
            .build()
    };
    assert_caught(model(true), "a cut training-only use");
    model(false).unwrap();
}

/// No false alarm on the project's own models: the candle Llama at its
/// presets, tied and untied, with its fused ops and their composite forms.
#[test]
fn the_llamas_build() {
    for vocab in [64, 257] {
        for (tie, fused) in [(false, true), (true, true), (false, false)] {
            let mut c = LlamaConfig::small(vocab);
            c.tie_word_embeddings = tie;
            c.fused_ops = fused;
            let m = c.build().unwrap_or_else(|e| panic!("vocab {vocab}, tie {tie}, fused {fused}: {e}"));
            assert!(
                m.gradient_check_notes().is_empty(),
                "checked in f64 throughout: {:?}",
                m.gradient_check_notes()
            );
        }
    }
    LlamaConfig::shape(96, 256, 2, 8, 2, 128).build().unwrap();
}

/// A whole weight cut from the graph is still a missing gradient, and a true
/// zero gradient still passes (the f64 influence test), at d 8 as at d 64:
/// `Tensor` arithmetic that cancels exactly (as an attention's key bias,
/// whose shift the softmax cancels) is the true gradient, not a cut path.
#[test]
fn zeros_and_missing_gradients_are_told_apart() {
    let vocab = 10;
    for d in [8, 64] {
        CandleModel::builder("cancel", vocab, 16)
            .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
            .stage("head", move |vb, x| {
                let w = vb.get(d, "shift")?;
                let y = x.broadcast_add(&(&w - &w)?)?;
                candle_nn::linear(d, vocab, vb.pp("out"))?.forward(&y)
            })
            .build()
            .unwrap();
    }
    let d = 64;
    let err = CandleModel::builder("gone", vocab, 16)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        .stage("head", move |vb, x| {
            let unused: Tensor = vb.get(d, "bias")?.detach();
            candle_nn::linear(d, vocab, vb.pp("out"))?.forward(&x.broadcast_add(&unused)?)
        })
        .build()
        .unwrap_err();
    assert!(matches!(err, CandleError::MissingGradient { .. }), "{err}");
}

/// A stage that makes an f32 tensor of its own cannot run in f64: its weights
/// are checked in f32, and the model says so.
#[test]
fn a_stage_that_cannot_run_in_f64_is_checked_in_f32_and_said() {
    let (vocab, d) = (10, 8);
    let model = CandleModel::builder("f32-only", vocab, 4)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        .stage("head", move |vb, x| {
            let w = vb.get((vocab, d), "weight")?;
            let scale = Tensor::full(0.5f32, (vocab, d), x.device())?;
            x.broadcast_matmul(&(w * scale)?.t()?)
        })
        .build()
        .unwrap();
    let notes = model.gradient_check_notes();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].contains("head.weight") && notes[0].contains("f32"), "{notes:?}");
}

/// Split over a job's processes, every weight is tested by exactly one share:
/// the cut weight (`mix.w`, the model's weight 1) fails the build of the
/// share that holds it, and only that one, for every number of parts.
#[test]
fn each_weight_is_tested_by_exactly_one_share() {
    let cut = |part, parts| {
        let vocab = 16;
        let d = 16;
        CandleModel::builder("two-uses", vocab, 8)
            .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
            .stage("mix", move |vb, x| {
                let w = vb.get((d, d), "w")?;
                let h = x.broadcast_matmul(&w.t()?)?;
                (x + &h)? + h.detach()
            })
            .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
            .check_share(part, parts)
            .build()
    };
    for parts in 1..=4 {
        for part in 0..parts {
            let r = cut(part, parts);
            if part == 1 % parts {
                assert_caught(r, &format!("share {part} of {parts}"));
            } else {
                let m = r.unwrap_or_else(|e| panic!("share {part} of {parts} holds no cut weight: {e}"));
                assert_eq!(m.gradient_check_share(), (part, parts));
            }
        }
    }
    assert!(matches!(cut(2, 2), Err(CandleError::Config(_))), "a share outside 0..parts is refused");
    assert!(matches!(cut(0, 0), Err(CandleError::Config(_))), "no parts is refused");
}
