//! Splits a shell command line into the simple commands a permission rule is matched
//! against, conservatively: where the split is not certain, it refuses ([`Unclear`]) and the
//! line is approved by no glob.
//!
//! A simple command ends at an unquoted `;`, `&`, `|` (so also `&&`, `||`, `|&`) or newline.
//! Quotes (`'…'`, `"…"`, `$'…'`), backslash escapes, line continuations and `#` comments are
//! understood as bash understands them. Refused: command substitution (`$(…)`, backticks) and
//! here-documents or here-strings (`<<`) anywhere in the line, even inside quotes; unquoted
//! parentheses (subshells, process substitution `<(…)`/`>(…)`, arithmetic, function
//! definitions, `case` patterns); a `${…}` expansion holding quotes, operators, nested
//! expansions or `@` transformations; unterminated quotes and a trailing backslash.
//!
//! Redirections stay in the simple command's text but are marked: a glob's wildcards do not
//! match their operators (see [`Char::wild`]), so `echo *` approves no `echo hi > file`.
//! Redirections that touch no file are dropped before matching: duplicating or closing a
//! descriptor (`2>&1`, `>&2`, `<&0`, `2>&-`) and `/dev/null` (`>/dev/null`, `2> /dev/null`,
//! `&>/dev/null`, `</dev/null`).
//!
//! A small hand-written lexer, not a crate: the word splitters (`shlex`, `shell-words`) do
//! not know operators, and full bash parsers bring large dependency trees and still need
//! these refusals on top.

/// One character of a simple command as matched by a glob.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Char {
    pub(crate) ch: char,
    /// A glob wildcard (`*`, `?`) may match it: false only for redirection operators, which
    /// a pattern must spell out.
    pub(crate) wild: bool,
}

/// One simple command of a line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SimpleCommand {
    /// As written (blanks collapsed, comments and harmless redirections dropped), marked
    /// for allow rules.
    pub(crate) chars: Vec<Char>,
    /// As written (blanks collapsed, comments dropped), with every redirection: what a
    /// reject rule is matched against.
    pub(crate) text: String,
}

/// Why a command line cannot be split with confidence.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Unclear {
    /// `$(…)` or backticks.
    #[error("it contains command substitution ($(…) or backticks)")]
    Substitution,
    /// `<<` (here-document, here-string).
    #[error("it contains a here-document or here-string (<<)")]
    HereDoc,
    /// An unquoted `(` or `)`.
    #[error(
        "it contains parentheses (a subshell, process substitution, arithmetic, a function or a case pattern)"
    )]
    Parenthesis,
    /// A `${…}` the splitter does not follow.
    #[error(
        "it contains a ${{…}} expansion with quotes, operators, nested expansions or transformations"
    )]
    Expansion,
    /// An unterminated quote or a trailing backslash.
    #[error("it has an unterminated quote or a trailing backslash")]
    Unterminated,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Word(String),
    Blank,
    /// A redirection operator with its descriptor number, e.g. `2>`, `&>>`, `<&`.
    Redirect(String),
}

/// Splits `line` into its simple commands (empty ones left out).
pub(crate) fn simple_commands(line: &str) -> Result<Vec<SimpleCommand>, Unclear> {
    if line.contains("$(") || line.contains('`') {
        return Err(Unclear::Substitution);
    }
    if line.contains("<<") {
        return Err(Unclear::HereDoc);
    }
    let chars: Vec<char> = line.chars().collect();
    let mut lexer = Lexer::default();
    let mut i = 0;
    while let Some(&c) = chars.get(i) {
        let next = chars.get(i + 1).copied();
        match c {
            ' ' | '\t' => {
                lexer.blank();
                i += 1;
            }
            '\n' | ';' | '|' => {
                lexer.end_command();
                i += 1;
            }
            '&' if next != Some('>') => {
                lexer.end_command();
                i += 1;
            }
            '&' | '<' | '>' => i = lexer.redirect(&chars, i)?,
            '(' | ')' => return Err(Unclear::Parenthesis),
            '#' if lexer.word.is_empty() => {
                // A comment: up to the newline, which still ends the command.
                while chars.get(i).is_some_and(|&c| c != '\n') {
                    i += 1;
                }
            }
            '\\' => match next {
                // A line continuation: both go, the word goes on.
                Some('\n') => i += 2,
                Some(escaped) => {
                    lexer.word.push(c);
                    lexer.word.push(escaped);
                    i += 2;
                }
                None => return Err(Unclear::Unterminated),
            },
            '\'' => {
                let end = closing(&chars, i + 1, '\'', false)?;
                lexer.word.extend(&chars[i..=end]);
                i = end + 1;
            }
            '"' => {
                let end = closing(&chars, i + 1, '"', true)?;
                lexer.word.extend(&chars[i..=end]);
                i = end + 1;
            }
            '$' if next == Some('\'') => {
                let end = ansi_c_end(&chars, i + 2)?;
                lexer.word.extend(&chars[i..=end]);
                i = end + 1;
            }
            '$' if next == Some('{') => {
                let end = brace_end(&chars, i + 1)?;
                lexer.word.extend(&chars[i..=end]);
                i = end + 1;
            }
            _ => {
                lexer.word.push(c);
                i += 1;
            }
        }
    }
    lexer.end_command();
    Ok(lexer.commands)
}

/// The index of the quote closing a quoted string whose text starts at `from`. Inside double
/// quotes a backslash escapes the next character and `${…}` is checked like outside.
fn closing(chars: &[char], from: usize, quote: char, double: bool) -> Result<usize, Unclear> {
    let mut j = from;
    loop {
        match chars.get(j) {
            None => return Err(Unclear::Unterminated),
            Some(&c) if c == quote => return Ok(j),
            Some('\\') if double => j += 2,
            Some('$') if double && chars.get(j + 1) == Some(&'{') => {
                j = brace_end(chars, j + 1)? + 1
            }
            Some(_) => j += 1,
        }
    }
}

/// The index of the quote closing an ANSI-C string (`$'…'`) whose text starts at `from`: a
/// backslash escapes the next character, `\'` included.
fn ansi_c_end(chars: &[char], from: usize) -> Result<usize, Unclear> {
    let mut j = from;
    loop {
        match chars.get(j) {
            None => return Err(Unclear::Unterminated),
            Some('\'') => return Ok(j),
            Some('\\') => j += 2,
            Some(_) => j += 1,
        }
    }
}

/// The index of the `}` closing the `${` whose `{` is at `open`; refuses expansions that
/// could hide quotes, operators, nested expansions or `@` transformations (`${x@P}`).
fn brace_end(chars: &[char], open: usize) -> Result<usize, Unclear> {
    let mut j = open + 1;
    loop {
        match chars.get(j) {
            None => return Err(Unclear::Expansion),
            Some('}') => return Ok(j),
            Some(
                '\'' | '"' | '\\' | '$' | '`' | ';' | '&' | '|' | '<' | '>' | '(' | ')' | '{'
                | '\n',
            ) => {
                return Err(Unclear::Expansion);
            }
            Some('@') if chars.get(j + 1).is_some_and(|c| c.is_alphabetic()) => {
                return Err(Unclear::Expansion);
            }
            Some(_) => j += 1,
        }
    }
}

#[derive(Default)]
struct Lexer {
    word: String,
    tokens: Vec<Token>,
    commands: Vec<SimpleCommand>,
}

impl Lexer {
    fn flush_word(&mut self) {
        if !self.word.is_empty() {
            self.tokens
                .push(Token::Word(std::mem::take(&mut self.word)));
        }
    }

    fn blank(&mut self) {
        self.flush_word();
        if self.tokens.last().is_some_and(|t| *t != Token::Blank) {
            self.tokens.push(Token::Blank);
        }
    }

    /// Lexes the redirection operator at `i` (`&>`, `&>>`, `>`, `>>`, `>&`, `>|`, `<`, `<&`,
    /// `<>`); a word of digits just before `<` or `>` is its descriptor. Returns the next
    /// index.
    fn redirect(&mut self, chars: &[char], i: usize) -> Result<usize, Unclear> {
        let both = chars[i] == '&';
        let descriptor =
            !both && !self.word.is_empty() && self.word.chars().all(|c| c.is_ascii_digit());
        let mut op = if descriptor {
            std::mem::take(&mut self.word)
        } else {
            self.flush_word();
            String::new()
        };
        let mut j = i;
        if both {
            op.push('&');
            j += 1;
        }
        let direction = chars[j];
        op.push(direction);
        j += 1;
        let second = match (both, direction, chars.get(j)) {
            (_, _, Some('(')) => return Err(Unclear::Parenthesis),
            (true, '>', Some('>')) => Some('>'),
            (false, '>', Some(&c @ ('>' | '&' | '|'))) => Some(c),
            (false, '<', Some(&c @ ('&' | '>'))) => Some(c),
            _ => None,
        };
        if let Some(c) = second {
            op.push(c);
            j += 1;
        }
        self.tokens.push(Token::Redirect(op));
        Ok(j)
    }

    fn end_command(&mut self) {
        self.flush_word();
        let tokens = std::mem::take(&mut self.tokens);
        let text = render(&tokens);
        let kept = without_harmless_redirections(tokens);
        let mut chars: Vec<Char> = Vec::new();
        for token in &kept {
            match token {
                Token::Word(w) => chars.extend(w.chars().map(|ch| Char { ch, wild: true })),
                Token::Blank => chars.push(Char {
                    ch: ' ',
                    wild: true,
                }),
                Token::Redirect(op) => chars.extend(op.chars().map(|ch| Char { ch, wild: false })),
            }
        }
        let blank = |c: &Char| c.ch == ' ' && c.wild;
        while chars.last().is_some_and(blank) {
            chars.pop();
        }
        let leading = chars.iter().take_while(|c| blank(c)).count();
        chars.drain(..leading);
        if !text.is_empty() {
            self.commands.push(SimpleCommand { chars, text });
        }
    }
}

fn render(tokens: &[Token]) -> String {
    let text: String = tokens
        .iter()
        .map(|t| match t {
            Token::Word(w) | Token::Redirect(w) => w.as_str(),
            Token::Blank => " ",
        })
        .collect();
    text.trim_matches(' ').to_owned()
}

/// Drops redirections that touch no file, with their target and the blank before them.
fn without_harmless_redirections(tokens: Vec<Token>) -> Vec<Token> {
    let mut kept: Vec<Token> = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        if let Token::Redirect(op) = &tokens[i] {
            let target = match tokens.get(i + 1) {
                Some(Token::Blank) => i + 2,
                _ => i + 1,
            };
            if let Some(Token::Word(word)) = tokens.get(target)
                && harmless(op, word)
            {
                if kept.last() == Some(&Token::Blank) {
                    kept.pop();
                }
                i = target + 1;
                continue;
            }
        }
        kept.push(tokens[i].clone());
        i += 1;
    }
    kept
}

fn harmless(op: &str, target: &str) -> bool {
    match op.trim_start_matches(|c: char| c.is_ascii_digit()) {
        ">&" | "<&" => target == "-" || target.chars().all(|c| c.is_ascii_digit()),
        ">" | ">>" | ">|" | "&>" | "&>>" | "<" => target == "/dev/null",
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split(line: &str) -> Vec<String> {
        match simple_commands(line) {
            Ok(commands) => commands
                .iter()
                .map(|c| c.chars.iter().map(|c| c.ch).collect())
                .collect(),
            Err(unclear) => panic!("{line:?}: {unclear}"),
        }
    }

    fn texts(line: &str) -> Vec<String> {
        match simple_commands(line) {
            Ok(commands) => commands.into_iter().map(|c| c.text).collect(),
            Err(unclear) => panic!("{line:?}: {unclear}"),
        }
    }

    #[test]
    fn operators_newlines_and_blanks_split_and_collapse() {
        assert_eq!(
            split("a  b;c&&d||e|f|&g&h\ni\t j ;; "),
            ["a b", "c", "d", "e", "f", "g", "h", "i j"]
        );
        assert!(split("").is_empty());
        assert!(split(" ;\n; # only a comment").is_empty());
    }

    #[test]
    fn quotes_escapes_and_continuations_keep_words_whole() {
        assert_eq!(
            split("echo 'a;b' \"c|d\" e\\&f"),
            ["echo 'a;b' \"c|d\" e\\&f"]
        );
        assert_eq!(split("echo $'x\\'y;z' w"), ["echo $'x\\'y;z' w"]);
        assert_eq!(split("echo \"a\\\"b;c\""), ["echo \"a\\\"b;c\""]);
        assert_eq!(split("ec\\\nho hi"), ["echo hi"]);
        assert_eq!(
            split("echo \"multi\nline\"; x"),
            ["echo \"multi\nline\"", "x"]
        );
        assert_eq!(
            split("echo ${HOME} \"${USER:-me}\" $# ${#x} ${a[@]}"),
            ["echo ${HOME} \"${USER:-me}\" $# ${#x} ${a[@]}"]
        );
    }

    #[test]
    fn comments_start_only_at_a_word_and_end_at_the_line() {
        assert_eq!(split("a # b; c\nd"), ["a", "d"]);
        assert_eq!(split("a;#b\nc"), ["a", "c"]);
        assert_eq!(split("a b#c; d"), ["a b#c", "d"]);
        assert_eq!(split("a '#'; d"), ["a '#'", "d"]);
        assert_eq!(split("a \\#b; d"), ["a \\#b", "d"]);
    }

    #[test]
    fn redirections_are_marked_and_harmless_ones_dropped() {
        let commands = simple_commands("echo hi 2>/tmp/x").unwrap_or_default();
        let marked: String = commands[0]
            .chars
            .iter()
            .map(|c| if c.wild { '.' } else { '^' })
            .collect();
        assert_eq!(marked, "........^^......");
        assert_eq!(
            split("a >x >>y 2>z &>v &>>w >&u <t <>s >|r 3<&q"),
            ["a >x >>y 2>z &>v &>>w >&u <t <>s >|r 3<&q"]
        );
        assert_eq!(
            split("a 2>&1 >&2 <&0 3>&- >/dev/null 2> /dev/null &>/dev/null </dev/null b"),
            ["a b"]
        );
        assert_eq!(
            texts("a 2>&1 b | c > /dev/null"),
            ["a 2>&1 b", "c > /dev/null"]
        );
        // Not a descriptor or /dev/null: kept.
        assert_eq!(
            split("a >&file 2>&1x > \"/dev/null\" 2>/dev/nullx"),
            ["a >&file 2>&1x > \"/dev/null\" 2>/dev/nullx"]
        );
        // A redirection is no command separator.
        assert_eq!(split("a >| b &> c >& d"), ["a >| b &> c >& d"]);
        // Digits before `&>` are an argument, not a descriptor: nothing of them is dropped.
        assert_eq!(split("rm 2&>/dev/null"), ["rm 2"]);
    }

    #[test]
    fn unclear_lines_are_refused_with_a_reason() {
        let cases = [
            ("a $(b)", Unclear::Substitution),
            ("a `b`", Unclear::Substitution),
            ("a '$(b)'", Unclear::Substitution),
            ("a $((1+2))", Unclear::Substitution),
            ("cat <<EOF\nx\nEOF", Unclear::HereDoc),
            ("cat <<< x", Unclear::HereDoc),
            ("(a)", Unclear::Parenthesis),
            ("a <(b)", Unclear::Parenthesis),
            ("a >(b)", Unclear::Parenthesis),
            ("f() { a; }", Unclear::Parenthesis),
            ("a ${x:-'b'}", Unclear::Expansion),
            ("a \"${x:-\"}\"", Unclear::Expansion),
            ("a ${x@P}", Unclear::Expansion),
            ("a ${x", Unclear::Expansion),
            ("a 'b", Unclear::Unterminated),
            ("a \"b", Unclear::Unterminated),
            ("a $'b\\'", Unclear::Unterminated),
            ("a \\", Unclear::Unterminated),
            ("a \"b\\", Unclear::Unterminated),
        ];
        for (line, reason) in cases {
            assert_eq!(simple_commands(line), Err(reason), "{line:?}");
        }
        // Quoted, a parenthesis is an argument.
        assert_eq!(
            split("echo '(a)' \"(b)\" \\(c\\)"),
            ["echo '(a)' \"(b)\" \\(c\\)"]
        );
    }

    /// Words, quotes, escapes, comments and redirections that bash runs as they are.
    fn argument() -> impl Strategy<Value = String> {
        prop_oneof![
            "[a-z0-9./_-]{1,5}",
            "'[a-z ;&|#<>()\"]{0,6}'",
            "\"[a-z ;&|#<>()']{0,6}\"",
            prop::sample::select(vec!["\\;", "\\&", "\\|", "\\#", "\\ ", "a\\\nb"])
                .prop_map(str::to_owned),
            "#[a-z ;&|'\"()]{0,6}",
            prop::sample::select(vec![
                ">/dev/null",
                "2>&1",
                ">out",
                "2> err",
                ">>out",
                "</dev/null"
            ])
            .prop_map(str::to_owned),
            Just("${HOME}".to_owned()),
            prop::collection::vec(
                prop::sample::select(vec!["a", " ", ";", "|", "&", "#", "\"", "\\'", "\\\\"]),
                0..5
            )
            .prop_map(|parts| format!("$'{}'", parts.concat())),
        ]
    }

    fn simple_command() -> impl Strategy<Value = String> {
        (
            prop::sample::select(vec!["echo", "true", ":"]),
            prop::collection::vec(argument(), 0..4),
        )
            .prop_map(|(name, args)| {
                std::iter::once(name.to_owned())
                    .chain(args)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
    }

    /// Simple commands joined by operators that run every one of them (after `&&` or `||`
    /// a failing `a\\\nb` would skip the rest and bash would count fewer).
    fn line() -> impl Strategy<Value = String> {
        (
            simple_command(),
            prop::collection::vec(
                (
                    prop::sample::select(vec![";", "|", "\n", " ; ", " | ", ";\n"]),
                    simple_command(),
                ),
                0..4,
            ),
        )
            .prop_map(|(first, rest)| {
                let mut line = first;
                for (op, command) in rest {
                    line.push_str(op);
                    line.push_str(&command);
                }
                line
            })
    }

    /// How many simple commands bash runs for `line`, from its xtrace on a descriptor of its
    /// own; `None` when bash finds a syntax error.
    fn bash_runs(line: &str, dir: &std::path::Path) -> Option<usize> {
        let trace = dir.join("trace");
        let script = format!(
            "exec 9>'{}'; BASH_XTRACEFD=9; set -x\n{line}\n",
            trace.display()
        );
        let out = std::process::Command::new("bash")
            .arg("--norc")
            .arg("--noprofile")
            .arg("-c")
            .arg(script)
            .current_dir(dir)
            .output()
            .expect("bash runs (it is on every Linux machine this builds on)");
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("syntax error") {
            return None;
        }
        let trace = std::fs::read_to_string(&trace).expect("the xtrace file");
        Some(trace.lines().filter(|l| l.starts_with('+')).count())
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

        /// The splitter and bash agree on how many simple commands a line runs.
        #[test]
        fn the_split_agrees_with_bash(line in line()) {
            // Refused even when quoted (tested above).
            prop_assume!(!line.contains("<<"));
            let dir = tempfile::tempdir().expect("a temp dir");
            let Some(runs) = bash_runs(&line, dir.path()) else {
                return Err(TestCaseError::reject("bash syntax error"));
            };
            let commands = simple_commands(&line)
                .map_err(|e| TestCaseError::fail(format!("{line:?}: {e}")))?;
            prop_assert_eq!(commands.len(), runs, "{:?} split as {:?}", line, commands);
        }

        /// Whatever the input, the splitter answers (no panic), and what it splits has no
        /// substitution or here-document in it.
        #[test]
        fn any_line_is_split_or_refused(line in "[a ;&|<>()'\"\\\\$`{}#\n21@-]{0,24}") {
            if simple_commands(&line).is_ok() {
                prop_assert!(!line.contains("$(") && !line.contains('`') && !line.contains("<<"));
            }
        }
    }
}
