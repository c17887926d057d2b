//! The futures of the async commits (feature `tokio`): settled by the committer thread
//! (`committer.rs`) through a one-shot channel.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::oneshot;

use crate::format::error::Result;
use crate::format::record::Committed;
use crate::storage::log::committer::committer_error;

/// The future of [`crate::Claim::commit_async`]: resolves to what [`crate::Claim::commit`] would have
/// returned.
///
/// Dropping it does not cancel the commit: the claim was handed over and is written with its
/// group all the same.
#[must_use = "the commit's outcome is only known by awaiting the future"]
#[derive(Debug)]
pub struct CommitFuture {
    state: State<Committed>,
}

/// The future of [`crate::ClaimBatch::commit_async`]: resolves to what [`crate::ClaimBatch::commit`] would
/// have returned. Dropping it does not cancel the commit.
#[must_use = "the commit's outcome is only known by awaiting the future"]
#[derive(Debug)]
pub struct BatchCommitFuture {
    state: State<Vec<Option<Committed>>>,
}

/// The receiving end of a commit's answer: sent by the committer thread, or at once by a
/// commit settled without it (a buffered commit, or one that failed its checks).
#[derive(Debug)]
struct State<T>(oneshot::Receiver<Result<T>>);

impl<T> State<T> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<T>> {
        Pin::new(&mut self.0).poll(cx).map(|answer| {
            // The sender is only dropped unanswered if the committer thread died, which only
            // a panic in it can do.
            answer.unwrap_or_else(|_| {
                Err(committer_error(
                    "the committer thread stopped before answering",
                ))
            })
        })
    }
}

impl Future for CommitFuture {
    type Output = Result<Committed>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Committed>> {
        self.state.poll(cx)
    }
}

impl Future for BatchCommitFuture {
    type Output = Result<Vec<Option<Committed>>>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<Option<Committed>>>> {
        self.state.poll(cx)
    }
}

impl CommitFuture {
    /// A future the committer will settle through `receiver`'s sender.
    pub(crate) fn waiting(receiver: oneshot::Receiver<Result<Committed>>) -> CommitFuture {
        CommitFuture {
            state: State(receiver),
        }
    }
}

impl BatchCommitFuture {
    /// A future the committer will settle through `receiver`'s sender.
    pub(crate) fn waiting(
        receiver: oneshot::Receiver<Result<Vec<Option<Committed>>>>,
    ) -> BatchCommitFuture {
        BatchCommitFuture {
            state: State(receiver),
        }
    }
}
