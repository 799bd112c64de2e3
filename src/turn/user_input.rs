//! ask_user: the runtime's `userInput.request` answered by a gateway handler.

use std::future::Future;
use std::pin::Pin;

use crate::rpc::messages::{UserInputRequest, UserInputResponse};

/// A question the model asks the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    /// The question.
    pub question: String,
    /// Offered answers (may be empty).
    pub choices: Vec<String>,
    /// Whether a free-text answer is allowed.
    pub allow_freeform: bool,
}

impl Question {
    pub(crate) fn from_wire(request: &UserInputRequest) -> Self {
        Self {
            question: request.question.clone(),
            choices: request.choices.clone().unwrap_or_default(),
            // The runtime allows free text unless it says otherwise.
            allow_freeform: request.allow_freeform.unwrap_or(true),
        }
    }
}

/// The gateway's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// The n-th choice (0-based).
    Choice(usize),
    /// A choice by its label (case-insensitive).
    Label(String),
    /// Free text (used only when the question allows it).
    FreeText(String),
}

/// `None`: no answer (the question gets an empty free-form answer).
pub type AnswerFuture = Pin<Box<dyn Future<Output = Option<Answer>> + Send>>;

/// Answers the model's questions.
pub trait UserInputHandler: Send + Sync + 'static {
    /// Asks the user.
    fn ask(&self, question: Question) -> AnswerFuture;
}

impl<F, Fut> UserInputHandler for F
where
    F: Fn(Question) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Option<Answer>> + Send + 'static,
{
    fn ask(&self, question: Question) -> AnswerFuture {
        Box::pin(self(question))
    }
}

/// The wire answer for `answer` to `question`: a choice by index or label, free text where
/// allowed; anything else (no answer, a bad index, free text where only choices are allowed)
/// becomes an empty free-form answer.
pub fn resolve(question: &Question, answer: Option<Answer>) -> UserInputResponse {
    let empty = UserInputResponse {
        answer: String::new(),
        was_freeform: true,
    };
    let choice = |label: &str| UserInputResponse {
        answer: label.to_owned(),
        was_freeform: false,
    };
    match answer {
        Some(Answer::Choice(i)) => question.choices.get(i).map(|l| choice(l)).unwrap_or(empty),
        Some(Answer::Label(label)) => {
            match question
                .choices
                .iter()
                .find(|c| c.eq_ignore_ascii_case(label.trim()))
            {
                Some(c) => choice(c),
                None if question.allow_freeform => UserInputResponse {
                    answer: label,
                    was_freeform: true,
                },
                None => empty,
            }
        }
        Some(Answer::FreeText(text)) if question.allow_freeform => UserInputResponse {
            answer: text,
            was_freeform: true,
        },
        Some(Answer::FreeText(text)) => match question
            .choices
            .iter()
            .find(|c| c.eq_ignore_ascii_case(text.trim()))
        {
            Some(c) => choice(c),
            None => empty,
        },
        None => empty,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(freeform: bool) -> Question {
        Question {
            question: "Pick".into(),
            choices: vec!["red".into(), "blue".into()],
            allow_freeform: freeform,
        }
    }

    #[test]
    fn answers_by_index_label_and_text() {
        let r = resolve(&q(true), Some(Answer::Choice(1)));
        assert_eq!((r.answer.as_str(), r.was_freeform), ("blue", false));
        let r = resolve(&q(true), Some(Answer::Label("RED".into())));
        assert_eq!((r.answer.as_str(), r.was_freeform), ("red", false));
        let r = resolve(&q(true), Some(Answer::FreeText("green".into())));
        assert_eq!((r.answer.as_str(), r.was_freeform), ("green", true));
    }

    #[test]
    fn invalid_or_missing_answers_become_empty_free_form() {
        for a in [
            None,
            Some(Answer::Choice(7)),
            Some(Answer::FreeText("green".into())),
            Some(Answer::Label("green".into())),
        ] {
            let r = resolve(&q(false), a.clone());
            assert_eq!((r.answer.as_str(), r.was_freeform), ("", true), "{a:?}");
        }
        let r = resolve(&q(false), Some(Answer::FreeText("blue".into())));
        assert_eq!((r.answer.as_str(), r.was_freeform), ("blue", false));
    }
}
