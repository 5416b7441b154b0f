//! The runtime a [`PostgresStore`](super::PostgresStore) owns: one thread
//! running a current-thread tokio runtime, on which every connection, every
//! statement and the reconnect probe run.
//!
//! Why a runtime of its own: the store must be safe to build, use and drop
//! from any thread — a tokio worker (current-thread or multi-thread), a
//! `spawn_blocking` thread, a plain thread with no runtime. Work is spawned
//! onto the store's runtime through its [`Handle`], and the caller waits in
//! the way its own context allows:
//!
//! - an async caller awaits a oneshot receiver, a runtime-agnostic future
//!   (nothing is ever `block_on`'d on the caller's runtime);
//! - a sync caller waits on a std channel: safe on any thread, including a
//!   tokio worker, which it blocks for one round trip like any blocking call.
//!
//! Every call is bounded ([`StoreRuntime::call`], [`StoreRuntime::spawn`]):
//! the task that runs it answers with a timeout error once the call timeout
//! passes, then lets the work run to its end, since a statement already
//! sent may still take effect, and hands a late answer to the call's
//! `abandoned` (a claim is given back). The bound is kept on the store's
//! runtime, so blocking and async callers get it alike, and no caller's
//! runtime needs a timer.
//!
//! The runtime is dropped on its own thread when the store is dropped
//! (dropping a runtime inside an async context panics), which also closes
//! every connection.

use super::errors::call_timed_out;
use crate::error::{Error, Result};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The store's runtime thread and the handle work is spawned through.
pub(super) struct StoreRuntime {
    handle: Handle,
    /// The bound on every call (`PostgresStoreBuilder::call_timeout`).
    call_timeout: std::time::Duration,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl StoreRuntime {
    /// Starts the thread. Safe inside an async context: building a runtime
    /// does not enter it, and the only `block_on` runs on the new thread.
    pub(super) fn start(call_timeout: std::time::Duration) -> Result<StoreRuntime> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(Error::Io)?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("idemstore-postgres".to_owned())
            .spawn(move || {
                // Runs the spawned work until the store is dropped (the
                // sender is dropped with it, which also ends this wait).
                runtime.block_on(async {
                    let _ = stopped.await;
                });
                // Cancels what is left (connection tasks, the probe) and
                // closes the sockets, on this thread, outside any async context.
                drop(runtime);
            })
            .map_err(Error::Io)?;
        Ok(StoreRuntime {
            handle,
            call_timeout,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Runs `work` on the store's runtime and blocks this thread until it
    /// answers, however long that takes (the build, a migration: bounded by
    /// their own timeouts). [`Error::Closed`] when the runtime is gone.
    pub(super) fn block_on<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let _ = tx.send(work.await);
        });
        // A task dropped unrun (the runtime shut down) drops `tx`.
        rx.recv().unwrap_or(Err(Error::Closed))
    }

    /// Runs `work` as a task on the store's runtime and blocks this thread
    /// until it ends; a panic in it is resumed on this thread (an inbox
    /// handler's). `None` when the runtime is gone.
    pub(super) fn block_on_task<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> Option<T> {
        let task = self.handle.spawn(work);
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.handle.spawn(async move {
            let _ = tx.send(task.await);
        });
        rx.recv().ok().and_then(joined)
    }

    /// [`block_on_task`](Self::block_on_task) as a future any executor can
    /// await: the panic is resumed on its awaiter.
    pub(super) fn spawn_task<T: Send + 'static>(
        &self,
        work: impl Future<Output = T> + Send + 'static,
    ) -> impl Future<Output = Option<T>> + Send + 'static {
        let task = self.handle.spawn(work);
        async move { joined(task.await) }
    }

    /// A call: runs `work` on the store's runtime and blocks this thread
    /// until it answers or the call timeout passes. `abandoned` gets an
    /// answer that came too late (a claim to give back).
    pub(super) fn call<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T>> + Send + 'static,
        abandoned: Option<Abandoned<T>>,
    ) -> Result<T> {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        self.bounded(work, abandoned, move |answer| {
            tx.send(answer)
                .map_err(|std::sync::mpsc::SendError(answer)| answer)
        });
        // A task dropped unrun (the runtime shut down) drops `tx`.
        rx.recv().unwrap_or(Err(Error::Closed))
    }

    /// A call whose answer is a future that any executor can await, within
    /// the call timeout. `abandoned` gets an answer nobody will see: one
    /// that came too late, or whose caller dropped the future first.
    pub(super) fn spawn<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T>> + Send + 'static,
        abandoned: Option<Abandoned<T>>,
    ) -> Answer<T> {
        let (tx, rx) = oneshot::channel();
        self.bounded(work, abandoned.clone(), move |answer| tx.send(answer));
        Answer { rx, abandoned }
    }

    /// Runs `work` as a task and gives its answer to `deliver`, or a
    /// timeout error when the call timeout passes first; then the work
    /// runs on (what it sent may take effect anyway) and an answer
    /// `deliver` could not take goes to `abandoned`.
    fn bounded<T: Send + 'static>(
        &self,
        work: impl Future<Output = Result<T>> + Send + 'static,
        abandoned: Option<Abandoned<T>>,
        deliver: impl FnOnce(Result<T>) -> std::result::Result<(), Result<T>> + Send + 'static,
    ) {
        let bound = self.call_timeout;
        self.handle.spawn(async move {
            let mut work = std::pin::pin!(work);
            let unseen = match tokio::time::timeout(bound, &mut work).await {
                Ok(answer) => deliver(answer).err(),
                Err(_) => {
                    let _ = deliver(Err(call_timed_out(bound)));
                    Some(work.await)
                }
            };
            if let (Some(answer), Some(abandoned)) = (unseen, abandoned) {
                abandoned(answer);
            }
        });
    }

    /// A handle for spawning work later (it outlives the runtime harmlessly:
    /// work spawned after the shutdown is dropped unrun).
    pub(super) fn handle(&self) -> Handle {
        self.handle.clone()
    }
}

/// A task's end as its caller sees it: the answer, the task's panic
/// resumed, or `None` when the runtime shut down under it.
fn joined<T>(ended: std::result::Result<T, tokio::task::JoinError>) -> Option<T> {
    match ended {
        Ok(answer) => Some(answer),
        Err(join) if join.is_panic() => std::panic::resume_unwind(join.into_panic()),
        Err(_) => None,
    }
}

impl Drop for StoreRuntime {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(thread) = self.thread.take() {
            // Joined so that the connections are closed when the store's
            // drop returns; never from the runtime's own thread (a store
            // dropped by work running there), which would wait for itself.
            if thread.thread().id() != std::thread::current().id() {
                let _ = thread.join();
            }
        }
    }
}

/// What to do with an answer its caller dropped the future for.
pub(super) type Abandoned<T> = std::sync::Arc<dyn Fn(Result<T>) + Send + Sync>;

/// The answer of work spawned on the store's runtime: a future that needs
/// no particular runtime (it is woken through the oneshot channel).
pub(super) struct Answer<T> {
    rx: oneshot::Receiver<Result<T>>,
    abandoned: Option<Abandoned<T>>,
}

impl<T> Future for Answer<T> {
    type Output = Result<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        match Pin::new(&mut self.rx).poll(cx) {
            Poll::Ready(answer) => {
                // Taken: nothing left to hand back on drop.
                self.abandoned = None;
                Poll::Ready(answer.unwrap_or(Err(Error::Closed)))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T> Drop for Answer<T> {
    fn drop(&mut self) {
        let Some(abandoned) = self.abandoned.take() else {
            return;
        };
        // After close() the task's send fails (and the task hands the answer
        // back itself), or it already succeeded and the answer is here.
        self.rx.close();
        if let Ok(answer) = self.rx.try_recv() {
            abandoned(answer);
        }
    }
}
