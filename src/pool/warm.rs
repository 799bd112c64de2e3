//! A warm spare's conversations: the pool remembers each key's most recently leased
//! conversations (what their last open needed, at most `warm_spare_conversations` per key;
//! every lease's open counts, an attached conversation's included) and resumes those
//! attached nowhere onto the key's spare ahead of their return. A returning
//! agent then finds its conversation attached and its turn starts at once, where it would
//! otherwise wait for `session.resume` on the spare (~30 ms on a primed process: all that
//! is left of a returning agent's wait once the spare has saved the start).
//!
//! Placement decides which resume may run ([`Placement::warm_up`]: the key keeps spares,
//! the spare has room, the conversation is attached nowhere and wanted by no lease); this
//! module remembers the opens and runs the resumes. A resume ahead is a lease's open with
//! `existing_only`: it never creates a session, and a failed one is abandoned like any
//! grant, so whatever it may have attached is detached with confirmation.
//!
//! [`Placement::warm_up`]: super::placement::Placement::warm_up

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;

use crate::ids::CliSessionId;
use crate::rpc::messages::SessionConfig;

use super::actor::{Grant, PoolMsg, Settle};
use super::bindings::BindingStore;
use super::key::PoolKey;
use super::lease::OpenReason;
use super::{OpenTarget, Opened};

/// What a conversation's last open used, kept to resume it ahead of its return.
#[derive(Debug)]
pub(crate) struct Reopen {
    /// The key whose spare may take it.
    pub(crate) key: PoolKey,
    /// The pool's conversation id (`<agent_id>/<session_key>`).
    pub(crate) conversation: String,
    /// The conversation's compat key (model, provider, directory, account).
    pub(crate) compat: String,
    /// The session's settings as placement compares them (`setup_key` of `config`).
    pub(crate) setup: String,
    /// Its `COPILOT_HOME`.
    pub(crate) home: PathBuf,
    /// What the lease opened the session with (its provider the guard's placeholder).
    pub(crate) config: SessionConfig,
    /// The CLI session id the caller chose, if it did.
    pub(crate) pinned: Option<CliSessionId>,
}

/// Each key's most recently leased conversations (each lease's open remembers its
/// conversation, attached or not), newest last, at most `limit` per key; a conversation is
/// remembered under one key only (its last).
#[derive(Debug, Default)]
pub(crate) struct Recent {
    per_key: HashMap<PoolKey, VecDeque<Arc<Reopen>>>,
    /// The key each remembered conversation is under.
    key_of: HashMap<String, PoolKey>,
    limit: usize,
}

impl Recent {
    /// Remembers at most `limit` conversations per key (0: none).
    pub(crate) fn new(limit: usize) -> Self {
        Recent {
            per_key: HashMap::new(),
            key_of: HashMap::new(),
            limit,
        }
    }

    /// Whether anything is remembered at all.
    pub(crate) fn enabled(&self) -> bool {
        self.limit > 0
    }

    /// `reopen` was the last open of its conversation: it becomes its key's newest (and is
    /// forgotten under any other key: after a rotation the old key's spare must not resume
    /// it with the old credentials), and the key's oldest is forgotten past the limit.
    pub(crate) fn remember(&mut self, reopen: Reopen) {
        if self.limit == 0 {
            return;
        }
        self.forget(&reopen.conversation);
        self.key_of
            .insert(reopen.conversation.clone(), reopen.key.clone());
        let recent = self.per_key.entry(reopen.key.clone()).or_default();
        recent.push_back(Arc::new(reopen));
        if recent.len() > self.limit
            && let Some(oldest) = recent.pop_front()
        {
            self.key_of.remove(&oldest.conversation);
        }
    }

    /// Forgets `conversation` wherever it is remembered.
    fn forget(&mut self, conversation: &str) {
        if let Some(key) = self.key_of.remove(conversation)
            && let Some(recent) = self.per_key.get_mut(&key)
        {
            recent.retain(|r| r.conversation != conversation);
            if recent.is_empty() {
                self.per_key.remove(&key);
            }
        }
    }

    /// Every remembered conversation, each key's newest first.
    pub(crate) fn candidates(&self) -> Vec<Arc<Reopen>> {
        self.per_key
            .values()
            .flat_map(|recent| recent.iter().rev().cloned())
            .collect()
    }

    /// A resume ahead of `reopen` was granted: it is forgotten until its conversation is
    /// opened again, so one that keeps failing is not retried at every tick.
    pub(crate) fn take(&mut self, reopen: &Reopen) {
        self.forget(&reopen.conversation);
    }

    /// Forgets the keys `keep` refuses (placement forgot them: no spare will come).
    pub(crate) fn retain_keys(&mut self, keep: impl Fn(&PoolKey) -> bool) {
        self.per_key.retain(|key, _| keep(key));
        let per_key = &self.per_key;
        self.key_of.retain(|_, key| per_key.contains_key(key));
    }
}

/// Resumes `reopen`'s conversation on the granted spare, then parks it there (`Opened`, then
/// `Return` with [`Settle::Park`]); a resume that fails drops the grant armed, and its guard
/// gives the conversation back with what it may have left attached.
pub(crate) async fn resume_ahead(
    mut grant: Grant,
    reopen: Arc<Reopen>,
    bindings: Arc<BindingStore>,
) {
    let worker = grant.worker.clone();
    let target = OpenTarget {
        worker: &worker,
        existing_only: true,
        pinned: reopen.pinned.as_ref(),
        session_key: &reopen.conversation,
        compat: &reopen.compat,
        home: &reopen.home,
        skip_resume: false,
        deleting: false,
    };
    match target
        .open(None, &bindings, ahead_config(&reopen.config))
        .await
    {
        // (A binding without the working directory is left to the conversation's own lease
        // to write again: only a conversation leased in this run is reopened ahead, and
        // that lease's open resumed it already.)
        Ok(Opened {
            session,
            reason: OpenReason::Resumed,
            ..
        }) => {
            if session.already_in_use() {
                crate::metrics::ownership_violated();
                tracing::error!(
                    cli_session_id = %session.id(),
                    "The runtime reports this session attached to another process (alreadyInUse); \
                     the one-owner rule was broken. Please report this."
                );
            }
            crate::metrics::session_opened(crate::metrics::COPILOT_BACKEND, OpenReason::Resumed);
            let _ = grant.pool.cast(PoolMsg::Opened {
                conversation: reopen.conversation.clone(),
                worker_id: grant.worker_id,
                cli_session_id: session.id().clone(),
                reason: OpenReason::Resumed,
                reopen: None,
            });
            grant.disarm();
            let _ = grant.pool.cast(PoolMsg::Return {
                conversation: reopen.conversation.clone(),
                worker_id: grant.worker_id,
                session: Some(session),
                settle: Settle::Park,
                turns: 0,
            });
            tracing::debug!(
                pid = worker.pid(),
                "Resumed a conversation on its key's spare ahead of its return."
            );
        }
        // Not a resume (nothing else opens with `existing_only`): detached by the guard.
        Ok(Opened { session, .. }) => grant.opened = Some(session),
        Err(failure) => {
            tracing::debug!(error = %failure.error, "A resume ahead of a conversation's return failed; it resumes when it returns.");
            grant.maybe_attached = failure.maybe_attached;
            grant.resume_crashed = failure.resume_crashed;
        }
    }
}

/// What a resume ahead opens with: the conversation's last open, except that whatever the
/// client asked for its own resumes, nobody is there to see unfinished work continue, so the
/// runtime must not restart it ahead of the return.
fn ahead_config(last: &SessionConfig) -> SessionConfig {
    SessionConfig {
        continue_pending_work: Some(false),
        ..last.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::AuthMode;

    fn key(n: u8) -> PoolKey {
        PoolKey {
            home: PathBuf::from(format!("/agents/{n}")),
            mode: AuthMode::Token,
            profile_id: None,
            profile_version: None,
            byok: None,
        }
    }

    fn reopen(k: u8, conversation: &str) -> Reopen {
        Reopen {
            key: key(k),
            conversation: conversation.to_owned(),
            compat: "c".to_owned(),
            setup: String::new(),
            home: PathBuf::from("/agents/1"),
            config: SessionConfig::default(),
            pinned: None,
        }
    }

    #[test]
    fn a_resume_ahead_never_continues_pending_work_whatever_the_last_open_asked() {
        let last = SessionConfig {
            continue_pending_work: Some(true),
            model: Some("m".into()),
            ..SessionConfig::default()
        };
        let config = ahead_config(&last);
        assert_eq!(config.continue_pending_work, Some(false));
        assert_eq!(
            config.model.as_deref(),
            Some("m"),
            "the rest is the last open's"
        );
        let wire = serde_json::to_value(&config).expect("serializes");
        assert_eq!(wire["continuePendingWork"], serde_json::json!(false));
    }

    fn names(recent: &Recent) -> Vec<String> {
        recent
            .candidates()
            .into_iter()
            .map(|r| r.conversation.clone())
            .collect()
    }

    #[test]
    fn each_key_keeps_its_newest_conversations_once_each_up_to_the_limit_newest_first() {
        let mut recent = Recent::new(2);
        recent.remember(reopen(1, "a/1"));
        recent.remember(reopen(1, "a/2"));
        recent.remember(reopen(1, "a/1"));
        assert_eq!(names(&recent), ["a/1", "a/2"], "reopened: newest, once");
        recent.remember(reopen(1, "a/3"));
        assert_eq!(
            names(&recent),
            ["a/3", "a/1"],
            "the oldest goes past the limit"
        );
        recent.remember(reopen(2, "b/1"));
        recent.retain_keys(|k| *k == key(2));
        assert_eq!(names(&recent), ["b/1"]);
        recent.take(&reopen(2, "b/1"));
        assert!(names(&recent).is_empty(), "taken until opened again");
        // Opened under a new key (a rotation): remembered there only.
        recent.remember(reopen(1, "a/9"));
        recent.remember(reopen(2, "a/9"));
        let keys: Vec<PoolKey> = recent.candidates().iter().map(|r| r.key.clone()).collect();
        assert_eq!(keys, [key(2)]);
    }

    #[test]
    fn a_limit_of_zero_remembers_nothing() {
        let mut recent = Recent::new(0);
        recent.remember(reopen(1, "a/1"));
        assert!(!recent.enabled());
        assert!(recent.candidates().is_empty());
    }
}
