//! Your own candle model, trained sharded with ZeRO++: stages in plain
//! candle-nn, one call on the thread backend, the same binary under mpirun.
//!
//! ```text
//! cargo run --release -p zeropp-candle --example train_your_model
//! cargo build --release -p zeropp-candle --features mpi --example train_your_model
//! mpirun -np 4 -x ZEROPP_LOCAL_SIZE=2 target/release/examples/train_your_model
//! ```
#![allow(clippy::unwrap_used)] // an example: failures abort
use candle_nn::{Module, VarBuilder};
use zeropp_candle::CandleModel;
use zeropp_engine::train::{DataChoice, TrainConfig, load_data, train_model};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Your tokenizer's ids work too: TextDataset::from_tokens(vocab, ids, 0.1).
    let (data, _) = load_data(&DataChoice::Markov { seed: 0, chars: 100_000 })?;
    let (vocab, d, seq) = (data.vocab_size(), 64, 32);
    let mlp = move |vb: VarBuilder<'_>, x: &candle_core::Tensor| {
        let h = candle_nn::linear(d, 4 * d, vb.pp("up"))?.forward(x)?.gelu()?;
        x + candle_nn::linear(4 * d, d, vb.pp("down"))?.forward(&h)?
    };
    // One stage per gather unit; the last returns [batch, seq, vocab] logits.
    let model = CandleModel::builder("my-model", vocab, seq)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        .stage("block0", mlp)
        .stage("block1", mlp)
        .stage("head", move |vb, x| candle_nn::linear(d, vocab, vb)?.forward(x))
        .build()?;
    // ZeRO++ (qwZ, hpZ, qgZ) by default, on 8 ranks as 2 simulated nodes of 4.
    let cfg = TrainConfig { steps: 200, ..TrainConfig::default() };
    #[cfg(feature = "mpi")]
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some() {
        use zeropp_engine::train_mpi::{MpiOptions, or_abort, train_model_mpi};
        let mpi = zeropp_comm::mpi::Mpi::init()?;
        let mut comm = mpi.communicator(MpiOptions::default())?;
        let t = *zeropp_comm::Communicator::topology(&comm);
        let mut cfg = TrainConfig { backend: zeropp_engine::train::Backend::Mpi, world: t.world(), ..cfg };
        cfg.local_size = t.local_size();
        cfg.engine.zero = zeropp_engine::ZeroConfig::zeropp(t.local_size()); // hpZ over this job's nodes
        if let Some(r) = or_abort(|| train_model_mpi(&mut comm, &model, &data, &cfg, &mut |_| {})) {
            println!("rank 0: loss {:.3} -> {:.3}", r.steps[0].loss, r.summary.final_loss);
        }
        return Ok(());
    }
    let r = train_model(&model, &data, &cfg)?;
    let s = &r.summary;
    println!("{}: loss {:.3} -> {:.3}, val {:?}", s.model, r.steps[0].loss, s.final_loss, s.val_loss);
    println!("cross-node bytes per step {} (model {})", s.bytes_per_step.inter, s.model_bytes_per_step.inter);
    Ok(())
}
