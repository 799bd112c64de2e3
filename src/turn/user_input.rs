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

/// Why an answer does not answer its question ([`check`]); the message names the answers
/// the question takes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvalidAnswer {
    /// A choice index past the question's choices.
    #[error("choice {index} is not one of the question's choices: {valid}")]
    NoSuchChoice {
        /// The index given.
        index: usize,
        /// What the question takes.
        valid: ValidAnswers,
    },
    /// A label or text that is none of the choices, where the question takes no free text.
    #[error("{text:?} is not one of the question's choices, and it takes no free text: {valid}")]
    NotAChoice {
        /// The text given.
        text: String,
        /// What the question takes.
        valid: ValidAnswers,
    },
}

/// The answers a question takes, as [`InvalidAnswer`] names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidAnswers {
    /// The choices' labels.
    pub choices: Vec<String>,
    /// Whether free text answers it too.
    pub allow_freeform: bool,
}

impl std::fmt::Display for ValidAnswers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let freeform = if self.allow_freeform {
            "or free text"
        } else {
            "no free text"
        };
        match self.choices.len() {
            0 if self.allow_freeform => f.write_str("it offers no choices; answer with free text"),
            0 => f.write_str(
                "it offers no choices and takes no free text, so no answer fits; leave it \
                 unanswered (it is answered empty at its timeout)",
            ),
            n => {
                let labels: Vec<String> = self.choices.iter().map(|c| format!("{c:?}")).collect();
                write!(
                    f,
                    "answer one of its {n} choices by index (0 to {}) or by label ({}), {freeform}",
                    n - 1,
                    labels.join(", ")
                )
            }
        }
    }
}

/// The wire answer for `answer` to `question`: a choice by index, a choice by its label
/// (case-insensitive; the label given is free text where the question allows it), or free
/// text where the question allows it (where it does not, text equal to a choice's label is
/// that choice). Anything else is refused with the answers the question takes.
pub fn check(question: &Question, answer: &Answer) -> Result<UserInputResponse, InvalidAnswer> {
    let choice = |label: &str| UserInputResponse {
        answer: label.to_owned(),
        was_freeform: false,
    };
    let free = |text: &str| UserInputResponse {
        answer: text.to_owned(),
        was_freeform: true,
    };
    let valid = || ValidAnswers {
        choices: question.choices.clone(),
        allow_freeform: question.allow_freeform,
    };
    let labelled = |text: &str| {
        question
            .choices
            .iter()
            .find(|c| c.eq_ignore_ascii_case(text.trim()))
    };
    match answer {
        Answer::Choice(i) => {
            question
                .choices
                .get(*i)
                .map(|l| choice(l))
                .ok_or_else(|| InvalidAnswer::NoSuchChoice {
                    index: *i,
                    valid: valid(),
                })
        }
        Answer::FreeText(text) if question.allow_freeform => Ok(free(text)),
        Answer::Label(text) | Answer::FreeText(text) => match labelled(text) {
            Some(c) => Ok(choice(c)),
            None if question.allow_freeform => Ok(free(text)),
            None => Err(InvalidAnswer::NotAChoice {
                text: text.clone(),
                valid: valid(),
            }),
        },
    }
}

/// The wire answer for `answer` to `question` ([`check`]); no answer, or one [`check`]
/// refuses, becomes an empty free-form answer (a handler of the library that answers
/// wrongly is not asked again: check answers with [`check`] before giving them).
pub fn resolve(question: &Question, answer: Option<Answer>) -> UserInputResponse {
    answer
        .and_then(|a| check(question, &a).ok())
        .unwrap_or(UserInputResponse {
            answer: String::new(),
            was_freeform: true,
        })
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

    #[test]
    fn a_wrong_answer_is_refused_with_the_answers_the_question_takes() {
        let index = check(&q(false), &Answer::Choice(5)).unwrap_err();
        assert!(matches!(
            index,
            InvalidAnswer::NoSuchChoice { index: 5, .. }
        ));
        let text = index.to_string();
        assert!(
            text.contains("0 to 1")
                && text.contains("\"red\", \"blue\"")
                && text.contains("no free text"),
            "{text}"
        );
        for wrong in [
            Answer::Label("green".into()),
            Answer::FreeText("green".into()),
        ] {
            let refused = check(&q(false), &wrong).unwrap_err();
            assert!(
                matches!(&refused, InvalidAnswer::NotAChoice { text, .. } if text == "green"),
                "{wrong:?}"
            );
        }
        // An index past the choices is wrong even where free text would do.
        assert!(check(&q(true), &Answer::Choice(2)).is_err());
        let free = check(&q(true), &Answer::Label("green".into())).unwrap();
        assert_eq!((free.answer.as_str(), free.was_freeform), ("green", true));
    }
}
