//! A checkpoint of the candle Llama, exported as `zeropp checkpoint export`
//! exports it, loads into candle-transformers' Llama under Hugging Face's
//! names and gives the same logits: the names and layouts are right.

use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models::llama::{Cache, Llama};
use zeropp_candle::LlamaConfig;
use zeropp_engine::RunConfig;
use zeropp_engine::config::ZeroConfig;
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::launch;
use zeropp_partition::checkpoint::CheckpointReader;

#[test]
fn an_export_loads_into_candle_transformers_llama_with_the_same_logits() {
    let data = load_data(&DataChoice::Markov { seed: 5, chars: 20_000 }).unwrap().0;
    let c = LlamaConfig::shape(data.vocab_size(), 32, 2, 4, 2, 16);
    let model = c.build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let run = RunConfig {
        world: 4,
        local_size: 2,
        steps: 5,
        eval_batches: 0,
        keep_params: true,
        save: Some(dir.path().join("ckpt")),
        engine: zeropp_engine::EngineConfig { zero: ZeroConfig::zeropp(2), ..RunConfig::tiny().engine },
        ..RunConfig::default()
    };
    let report = launch(&model, &data, &run).unwrap();
    let out = dir.path().join("model.safetensors");
    CheckpointReader::open(&dir.path().join("ckpt")).unwrap().export_safetensors(&out).unwrap();

    let dev = Device::Cpu;
    let tensors = candle_core::safetensors::load(&out, &dev).unwrap();
    assert!(tensors.contains_key("model.layers.1.self_attn.k_proj.weight"), "{:?}", tensors.keys());
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &dev);
    let hf = crate::hf_config(&c, false);
    let llama = Llama::load(vb, &hf).unwrap();
    let params = report.params.unwrap();
    let ids: Vec<u32> = (0..c.seq_len as u32).map(|i| (i * 7 + 3) % c.vocab as u32).collect();
    for t in [1, 5, c.seq_len] {
        let mut cache = Cache::new(false, DType::F32, &hf, &dev).unwrap();
        let input = Tensor::from_slice(&ids[..t], (1, t), &dev).unwrap();
        // candle-transformers returns the last position's logits.
        let theirs =
            llama.forward(&input, 0, &mut cache).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let ours = model.logits(&params, &ids[..t], 1, t).unwrap();
        let ours = &ours[(t - 1) * c.vocab..t * c.vocab];
        let scale = theirs.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let diff = ours.iter().zip(&theirs).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        eprintln!("export: {t} tokens, max |logit difference| / max |logit| = {:.2e}", diff / scale);
        assert!(diff <= 1e-4 * scale, "{t} tokens: logits differ by {diff} (scale {scale})");
    }
}
