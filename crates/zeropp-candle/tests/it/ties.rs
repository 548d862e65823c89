//! Tied parameters and dropout: a tied weight's gradient is the sum of both
//! uses (checked against an untied twin), it trains sharded, and the tied
//! Llama exports as Hugging Face's `tie_word_embeddings`; dropout's masks are
//! replayed by the recompute, and evaluation runs without them.

use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder};
use candle_transformers::models::llama::{Cache, Llama};
use zeropp_candle::model::CandleModelBuilder;
use zeropp_candle::{CandleModel, LlamaConfig};
use zeropp_engine::config::{CommDtype, ZeroConfig};
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::model::{Model, full_forward, full_forward_backward, init_params};
use zeropp_engine::{RunConfig, launch};
use zeropp_partition::checkpoint::CheckpointReader;

use crate::batch;

const V: usize = 14;
const D: usize = 8;

/// Embedding, a block, and a head whose weight is `[V, D]` like the embedding's.
fn lm(tied: bool, keep: bool) -> CandleModelBuilder {
    let b = CandleModel::builder("lm", V, 5)
        .stage("embed", |vb, ids| candle_nn::embedding(V, D, vb)?.forward(ids))
        .stage("block", |vb, x| x + candle_nn::linear(D, D, vb.pp("fc"))?.forward(x)?.tanh()?)
        .stage("head", |vb, x| candle_nn::Linear::new(vb.get((V, D), "weight")?, None).forward(x))
        .keep_graph(keep);
    if tied { b.tie("embed.weight", "head.weight") } else { b }
}

fn worst(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / scale).fold(0.0, f32::max)
}

#[test]
fn a_tied_gradient_is_the_sum_of_both_uses() {
    let untied = lm(false, false).build().unwrap();
    for keep in [false, true] {
        let tied = lm(true, keep).build().unwrap();
        assert_eq!(tied.layers()[2].params.len(), 0, "the head stores no copy");
        let params = init_params(&tied, 3).unwrap();
        // The untied twin, its head set to the embedding.
        let mut twin = params.clone();
        twin[2] = params[0].clone();
        let b = batch(V, 3, 5, 2);
        let (loss, grads) = full_forward_backward(&tied, &params, &b).unwrap();
        let (twin_loss, twin_grads) = untied.reference_gradients(&twin, &b).unwrap();
        assert!((loss - twin_loss).abs() < 1e-6, "keep {keep}: {loss} vs {twin_loss}");
        let sum: Vec<f32> = twin_grads[0].iter().zip(&twin_grads[2]).map(|(a, b)| a + b).collect();
        let e = worst(&grads[0], &sum);
        assert!(e < 1e-5, "keep {keep}: the tied gradient is off the sum of both uses by {e}");
        assert!(worst(&grads[1], &twin_grads[1]) < 1e-5);
        // The whole-graph reference of the tied model agrees too.
        let (_, whole) = tied.reference_gradients(&params, &b).unwrap();
        assert!(worst(&grads[0], &whole[0]) < 1e-5);
        // And the logits use the embedding as the head.
        let logits = tied.logits(&params, &b.inputs, b.batch, b.seq_len).unwrap();
        let twin_logits = untied.logits(&twin, &b.inputs, b.batch, b.seq_len).unwrap();
        assert!(worst(&logits, &twin_logits) < 1e-6);
    }
}

#[test]
fn bad_ties_are_refused_when_built() {
    let cases: [(CandleModelBuilder, &str); 3] = [
        (
            lm(false, false).tie("embed.weight", "head.bias"),
            "no stage asks for a parameter named \"head.bias\"",
        ),
        (lm(false, false).tie("embed.weight", "block.fc.weight"), "has shape [14, 8]"),
        (lm(false, false).tie("embed.weight", "embed.weight"), "tied to itself"),
    ];
    for (b, says) in cases {
        let err = b.build().map(|_| ()).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
    }
}

/// The tied model trains under ZeRO-3 (f32) on 2 x 2 exactly as on one rank,
/// and under ZeRO++.
#[test]
fn a_tied_model_trains_sharded() {
    let data = load_data(&DataChoice::Markov { seed: 4, chars: 8_000 }).unwrap().0;
    let c =
        LlamaConfig { tie_word_embeddings: true, ..LlamaConfig::shape(data.vocab_size(), 16, 1, 2, 2, 8) };
    let model = c.build().unwrap();
    assert!(model.layers().iter().all(|l| l.params.iter().all(|p| p.name != "lm_head.weight")));
    let run = |world, local, zero| RunConfig {
        world,
        local_size: local,
        steps: 6,
        eval_batches: 1,
        keep_params: true,
        engine: zeropp_engine::EngineConfig { zero, ..RunConfig::tiny().engine },
        ..RunConfig::default()
    };
    let f32z = ZeroConfig { comm_dtype: CommDtype::F32, ..ZeroConfig::zero3() };
    let one = launch(&model, &data, &run(1, 1, f32z)).unwrap();
    let four = launch(&model, &data, &run(4, 2, f32z)).unwrap();
    for (a, b) in one.steps.iter().zip(&four.steps) {
        assert!((a.loss - b.loss).abs() <= 2e-4 * a.loss, "{} vs {}", a.loss, b.loss);
    }
    let pp = launch(&model, &data, &run(4, 2, ZeroConfig::zeropp(2))).unwrap();
    assert!(pp.steps[5].loss < pp.steps[0].loss);
}

#[test]
fn a_tied_llama_exports_as_hugging_face_ties_it() {
    let data = load_data(&DataChoice::Markov { seed: 5, chars: 20_000 }).unwrap().0;
    let c =
        LlamaConfig { tie_word_embeddings: true, ..LlamaConfig::shape(data.vocab_size(), 32, 2, 4, 2, 16) };
    let model = c.build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = RunConfig {
        world: 4,
        local_size: 2,
        steps: 4,
        eval_batches: 0,
        keep_params: true,
        save: Some(dir.path().join("ckpt")),
        engine: zeropp_engine::EngineConfig { zero: ZeroConfig::zeropp(2), ..RunConfig::tiny().engine },
        ..RunConfig::default()
    };
    let report = launch(&model, &data, &cfg).unwrap();
    let out = dir.path().join("model.safetensors");
    CheckpointReader::open(&dir.path().join("ckpt")).unwrap().export_safetensors(&out).unwrap();
    let tensors = candle_core::safetensors::load(&out, &Device::Cpu).unwrap();
    assert!(!tensors.contains_key("lm_head.weight"), "a tied head is not stored");
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let hf = crate::hf_config(&c, true);
    let llama = Llama::load(vb, &hf).unwrap();
    let params = report.params.unwrap();
    let ids: Vec<u32> = (0..c.seq_len as u32).map(|i| (i * 5 + 1) % c.vocab as u32).collect();
    let t = c.seq_len;
    let mut cache = Cache::new(false, DType::F32, &hf, &Device::Cpu).unwrap();
    let input = Tensor::from_slice(&ids, (1, t), &Device::Cpu).unwrap();
    let theirs =
        llama.forward(&input, 0, &mut cache).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let ours = model.logits(&params, &ids, 1, t).unwrap();
    let e = worst(&ours[(t - 1) * c.vocab..], &theirs);
    assert!(e < 1e-4, "tied export: logits differ by {e} of the largest");
}

/// A model with dropout 0.1 in two stages (`stage_with`).
fn dropout_lm(p: f32, keep: bool) -> CandleModel {
    CandleModel::builder("drop", V, 5)
        .stage_with("embed", move |vb, ids, ctx| {
            ctx.dropout(&candle_nn::embedding(V, D, vb)?.forward(ids)?, p)
        })
        .stage_with("block", move |vb, x, ctx| {
            let h = candle_nn::linear(D, 2 * D, vb.pp("up"))?.forward(x)?.relu()?;
            // Two draws in one stage: each replays.
            let h = ctx.dropout(&ctx.dropout(&h, p)?, p)?;
            x + candle_nn::linear(2 * D, D, vb.pp("down"))?.forward(&h)?
        })
        .stage("head", |vb, x| candle_nn::linear(D, V, vb)?.forward(x))
        .keep_graph(keep)
        .build()
        .unwrap()
}

#[test]
fn dropout_is_replayed_by_the_recompute() {
    for keep in [false, true] {
        let model = dropout_lm(0.1, keep);
        let params = init_params(&model, 6).unwrap();
        let b = batch(V, 4, 5, 7);
        let (loss, grads) = full_forward_backward(&model, &params, &b).unwrap();
        // One whole graph with the same masks (the same stage seeds).
        let (whole_loss, whole) = model.reference_gradients(&params, &b).unwrap();
        assert_eq!(loss.to_bits(), whole_loss.to_bits(), "keep {keep}");
        for (l, (g, w)) in grads.iter().zip(&whole).enumerate() {
            let e = worst(g, w);
            assert!(e < 1e-6, "keep {keep}: stage {l}'s gradient is off the whole graph's by {e}");
        }
        // The masks drop something: without dropout the loss differs.
        let plain = dropout_lm(0.0, keep);
        let plain_loss = full_forward(&plain, &params, &b).unwrap().0;
        assert_ne!(loss.to_bits(), plain_loss.to_bits(), "dropout changed nothing");
        // Evaluation runs without dropout.
        let mut tape = model.start_eval(&b).unwrap();
        for (l, p) in params.iter().enumerate() {
            model.forward(l, p, &mut tape).unwrap();
        }
        assert_eq!(model.loss(&tape).to_bits(), plain_loss.to_bits(), "evaluation ran with dropout");
        let logits = model.logits(&params, &b.inputs, b.batch, b.seq_len).unwrap();
        assert_eq!(logits, plain.logits(&params, &b.inputs, b.batch, b.seq_len).unwrap());
    }
}

/// The engine's validation (after training) runs in evaluation mode: with a
/// learning rate of 0 the weights stay at init, so the dropout model's
/// validation loss must be the plain model's.
#[test]
fn the_engines_validation_runs_without_dropout() {
    let data = load_data(&DataChoice::Markov { seed: 2, chars: 4_000 }).unwrap().0;
    let (v, seq) = (data.vocab_size(), 5);
    let build = |p: f32| {
        CandleModel::builder("val", v, seq)
            .stage_with("embed", move |vb, ids, ctx| {
                ctx.dropout(&candle_nn::embedding(v, D, vb)?.forward(ids)?, p)
            })
            .stage("head", move |vb, x| candle_nn::linear(D, v, vb)?.forward(x))
            .build()
            .unwrap()
    };
    let mut engine = RunConfig::tiny().engine;
    engine.optim.lr = 0.0;
    let cfg =
        RunConfig { world: 2, local_size: 2, steps: 1, eval_batches: 2, engine, ..RunConfig::default() };
    let with = launch(&build(0.5), &data, &cfg).unwrap();
    let without = launch(&build(0.0), &data, &cfg).unwrap();
    assert_ne!(with.steps[0].loss.to_bits(), without.steps[0].loss.to_bits(), "training ran without dropout");
    assert_eq!(
        with.summary.val_loss.unwrap().to_bits(),
        without.summary.val_loss.unwrap().to_bits(),
        "validation ran with dropout"
    );
}
