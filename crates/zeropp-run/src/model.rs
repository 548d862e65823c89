//! [`RunModel`]: whichever built-in model a [`ModelChoice`](crate::train::ModelChoice)
//! builds (the engine's GPT or MLP, or zeropp-candle's Llama) as one
//! [`Model`](zeropp_engine::Model), so one `launch` call trains any of them.

use zeropp_candle::CandleModel;
use zeropp_engine::model::Either;
use zeropp_engine::{Gpt, Mlp};

/// The engine's own models: the GPT ([`Either::Left`]) or the MLP.
pub type NativeModel = Either<Gpt, Mlp>;

/// A built-in model of any kind: a [`NativeModel`] ([`Either::Left`]) or
/// zeropp-candle's Llama decoder ([`Either::Right`]).
pub type RunModel = Either<NativeModel, CandleModel>;
