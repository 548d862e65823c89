//! Your own candle model, trained sharded with ZeRO++: stages in plain
//! candle-nn, one `launch` call: threads here, one rank per process under an
//! MPI launcher (OpenMPI, MPICH/Hydra, Slurm), with the same binary.
//!
//! ```text
//! cargo run --release -p zeropp-candle --example train_your_model
//! cargo build --release -p zeropp-candle --features mpi --example train_your_model
//! mpirun -np 4 -x ZEROPP_LOCAL_SIZE=2 target/release/examples/train_your_model
//! ```
#![allow(clippy::unwrap_used)] // an example: failures abort
use candle_nn::{Module, VarBuilder};
use zeropp_candle::{CandleModel, StageContext};
use zeropp_engine::data::{DataChoice, load_data};
use zeropp_engine::{RunConfig, launch};

fn main() -> Result<(), zeropp_candle::CandleError> {
    zeropp_candle::alloc::retain_freed_memory(); // candle allocates per op
    // Your tokenizer's ids work too: TextDataset::from_tokens(vocab, ids, 0.1).
    let (data, _) = load_data(&DataChoice::Markov { seed: 0, chars: 100_000 })?;
    let (vocab, d, seq) = (data.vocab_size(), 64, 32);
    // A pre-norm MLP block: LayerNorm (zeropp_candle::nn: candle-nn's, with a
    // backward pass), dropout that the backward's recompute replays.
    let mlp = move |vb: VarBuilder<'_>, x: &candle_core::Tensor, ctx: &StageContext| {
        let h = zeropp_candle::nn::layer_norm(d, 1e-5, vb.pp("ln"))?.forward(x)?;
        let h = candle_nn::linear(d, 4 * d, vb.pp("up"))?.forward(&h)?.gelu()?;
        x + ctx.dropout(&candle_nn::linear(4 * d, d, vb.pp("down"))?.forward(&h)?, 0.1)?
    };
    // One stage per gather unit; the last returns [batch, seq, vocab] logits.
    // The head is tied to the embedding: one parameter, both uses' gradients.
    let model = CandleModel::builder("my-model", vocab, seq)
        .stage("embed", move |vb, ids| candle_nn::embedding(vocab, d, vb)?.forward(ids))
        .stage_with("block0", mlp)
        .stage_with("block1", mlp)
        .stage("head", move |vb, x| candle_nn::Linear::new(vb.get((vocab, d), "weight")?, None).forward(x))
        .tie("embed.weight", "head.weight")
        .build()?;
    // ZeRO++ (qwZ, hpZ, qgZ) by default, on 8 ranks as 2 simulated nodes of 4;
    // under mpirun, mpiexec or srun, one rank per process on the job's nodes.
    let r = launch(&model, &data, &RunConfig::default().with_steps(200))?;
    if r.rank != 0 {
        return Ok(());
    }
    let s = &r.summary;
    let nodes = s.world / s.local_size;
    println!("{}: loss {:.3} -> {:.3}, val {:?}", s.model, r.steps[0].loss, s.final_loss, s.val_loss);
    println!("on {} ranks = {nodes} nodes x {}", s.world, s.local_size);
    println!("cross-node bytes per step {} (model {})", s.bytes_per_step.inter, s.model_bytes_per_step.inter);
    Ok(())
}
