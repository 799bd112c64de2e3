//! Calling code the crate does not own (a gateway's tool, permission policy, ask_user or hook
//! handler) so that a panic becomes a value the caller answers with: the runtime never waits
//! on a request because a handler panicked.

use std::any::Any;
use std::fmt;
use std::future::{Future, Ready, ready};
use std::panic::AssertUnwindSafe;

use futures_util::FutureExt;
use futures_util::future::{CatchUnwind, Either, Map};

/// A caught panic, by its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Panicked(String);

impl Panicked {
    fn from_payload(payload: Box<dyn Any + Send>) -> Self {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        Panicked(message)
    }
}

impl fmt::Display for Panicked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What [`call_guarded`] returns.
pub(crate) type Guarded<F> = Either<
    Map<
        CatchUnwind<AssertUnwindSafe<F>>,
        fn(std::thread::Result<<F as Future>::Output>) -> Result<<F as Future>::Output, Panicked>,
    >,
    Ready<Result<<F as Future>::Output, Panicked>>,
>;

/// Calls `call` now, which builds a future, and returns a future that runs it. A panic while
/// building or while the future is polled ends the returned future with `Err(Panicked)`.
pub(crate) fn call_guarded<F: Future>(call: impl FnOnce() -> F) -> Guarded<F> {
    match std::panic::catch_unwind(AssertUnwindSafe(call)) {
        Ok(future) => Either::Left(
            AssertUnwindSafe(future)
                .catch_unwind()
                .map(caught::<F::Output>),
        ),
        Err(payload) => Either::Right(ready(Err(Panicked::from_payload(payload)))),
    }
}

/// Calls `call` now; a panic in it is `Err(Panicked)`.
pub(crate) fn call_guarded_now<T>(call: impl FnOnce() -> T) -> Result<T, Panicked> {
    caught(std::panic::catch_unwind(AssertUnwindSafe(call)))
}

fn caught<T>(result: std::thread::Result<T>) -> Result<T, Panicked> {
    result.map_err(Panicked::from_payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_handler_that_returns_gives_its_output() {
        assert_eq!(call_guarded(|| async { 7 }).await, Ok(7));
    }

    #[tokio::test]
    async fn a_panic_while_building_the_future_is_caught_with_its_message() {
        let guarded = call_guarded(|| -> std::future::Ready<u8> { panic!("no future for you") });
        assert_eq!(guarded.await, Err(Panicked("no future for you".to_owned())));
    }

    #[tokio::test]
    async fn a_panic_while_the_future_runs_is_caught_with_its_formatted_message() {
        let code = 42;
        let result = call_guarded(|| async move {
            tokio::task::yield_now().await;
            if code == 42 {
                panic!("tool {code} failed");
            }
            code
        })
        .await;
        assert_eq!(result, Err(Panicked("tool 42 failed".to_owned())));
        assert_eq!(result.unwrap_err().to_string(), "tool 42 failed");
    }

    #[tokio::test]
    async fn a_panic_with_another_payload_is_an_unknown_panic() {
        let result = call_guarded(|| async { std::panic::panic_any(5_u32) }).await;
        assert_eq!(result, Err::<(), _>(Panicked("unknown panic".to_owned())));
    }

    #[test]
    fn the_handler_is_called_before_the_future_is_polled() {
        let mut called = false;
        let _unpolled = call_guarded(|| {
            called = true;
            async {}
        });
        assert!(called);
    }
}
