//! Root-cause analysis: when ranks fail, one rank's own error usually makes its
//! peers fail too (they lose it mid-collective). The report names the rank
//! that failed first, not one of the echoes.

use zeropp_comm::{CommError, RunError};

use crate::EngineError;

/// True for a communication failure that merely echoes another rank's death.
fn is_echo(e: &EngineError) -> bool {
    matches!(e, EngineError::Comm(CommError::PeerLost { .. } | CommError::Closed(_)))
}

/// Picks the root cause among the ranks' failures: a panic, else a rank's own
/// error (not a communication failure echoing another rank's death), else the first.
pub(crate) fn root_cause(errors: Vec<RunError<EngineError>>) -> EngineError {
    let pick = errors
        .iter()
        .position(|e| matches!(e, RunError::Panicked { .. }))
        .or_else(|| {
            errors.iter().position(|e| matches!(e, RunError::Failed { error, .. } if !is_echo(error)))
        })
        .unwrap_or(0);
    match errors.into_iter().nth(pick) {
        Some(RunError::Panicked { rank, message }) => {
            EngineError::RankFailed { rank, cause: Box::new(EngineError::Panicked(message)) }
        }
        Some(RunError::Failed { rank, error }) => EngineError::RankFailed { rank, cause: Box::new(error) },
        Some(RunError::Setup(e)) => EngineError::ClusterSetup(e),
        None => EngineError::Training("the run failed without an error".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lost(rank: usize, peer: usize) -> RunError<EngineError> {
        let source = CommError::PeerLost { rank: peer, reason: "hung up".into() };
        RunError::Failed { rank, error: EngineError::Comm(source) }
    }

    fn own(rank: usize) -> RunError<EngineError> {
        RunError::Failed { rank, error: EngineError::Training("boom".into()) }
    }

    fn failed_rank(e: &EngineError) -> Option<usize> {
        match e {
            EngineError::RankFailed { rank, .. } => Some(*rank),
            _ => None,
        }
    }

    #[test]
    fn a_rank_own_error_wins_over_the_echoes() {
        let e = root_cause(vec![lost(0, 2), lost(1, 2), own(2), lost(3, 2)]);
        assert_eq!(failed_rank(&e), Some(2));
        assert!(e.to_string().contains("boom"), "{e}");
    }

    #[test]
    fn a_panic_wins_over_everything() {
        let panic = RunError::Panicked { rank: 3, message: "index out of bounds".into() };
        let e = root_cause(vec![own(0), lost(1, 3), panic]);
        assert_eq!(failed_rank(&e), Some(3));
        assert!(e.to_string().contains("panicked: index out of bounds"), "{e}");
    }

    #[test]
    fn only_echoes_name_the_first_and_nothing_is_still_an_error() {
        assert_eq!(failed_rank(&root_cause(vec![lost(1, 0), lost(2, 0)])), Some(1));
        assert!(matches!(root_cause(Vec::new()), EngineError::Training(_)));
    }
}
