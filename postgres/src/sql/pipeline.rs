//! Requests sent one behind the other on a connection without waiting for answers in between.
//!
//! tokio-postgres sends a request when its future is first polled, and the server runs the
//! requests of a connection in the order they arrive, so futures polled in order are pipelined.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use futures_util::future::{MaybeDone, maybe_done};

/// Awaits every future, polling them in the order given every time: the first poll of each
/// sends its request, so the requests go out in that order. (A general join may poll in any
/// order.)
pub(crate) async fn in_order<F: Future>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut futures: Vec<Pin<Box<MaybeDone<F>>>> = futures
        .into_iter()
        .map(|f| Box::pin(maybe_done(f)))
        .collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for future in &mut futures {
            pending |= future.as_mut().poll(cx).is_pending();
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    futures
        .iter_mut()
        .filter_map(|future| future.as_mut().take_output())
        .collect()
}
