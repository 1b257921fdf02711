"""`corral run MODEL` on a terminal: Ollama's interactive session, its commands and wording
(ollama's cmd/interactive.go): /set, /unset, /show, /load, /save, /clear, /bye, /? and the
`Send a message (/? for help)` hint in the empty prompt."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import tty
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from corral.cli.chat import TokenPrinter, load_model, print_stats, stream_reply
from corral.cli.client import JSON, Client, CLIError, Unreachable
from corral.cli.display import _isatty
from corral.cli.models import format_show
from corral.core.options import REQUEST_OPTIONS

HINT = "Send a message (/? for help)"

USAGE = '''Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a session or model
  /save <model>   Save your current session
  /clear          Clear session context
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use """ to begin a multi-line message.
'''

USAGE_SET = """Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set history           Enable history
  /set nohistory         Disable history
  /set wordwrap          Enable wordwrap
  /set nowordwrap        Disable wordwrap
  /set format json       Enable JSON mode
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats
  /set think             Enable thinking
  /set nothink           Disable thinking
  /unset parameter <name>, /unset system, /unset format   Undo a /set
"""

USAGE_SHOW = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template
"""

USAGE_PARAMETERS = """Available Parameters:
  /set parameter seed <int>             Random number seed
  /set parameter num_predict <int>      Max number of tokens to predict
  /set parameter top_k <int>            Pick from top k num of tokens
  /set parameter top_p <float>          Pick token based on sum of probabilities
  /set parameter min_p <float>          Pick token based on top token probability * min_p
  /set parameter num_ctx <int>          Set the context size
  /set parameter temperature <float>    Set creativity level
  /set parameter repeat_penalty <float> How strongly to penalize repetitions
  /set parameter repeat_last_n <int>    Set how far back to look for repetitions
  /set parameter num_gpu <int>          The number of layers to send to the GPU
  /set parameter stop <string> <string> ...   Set the stop parameters
"""

USAGE_SHORTCUTS = """Available keyboard shortcuts:
  Ctrl + a            Move to the beginning of the line (Home)
  Ctrl + e            Move to the end of the line (End)
   Alt + b            Move back (left) one word
   Alt + f            Move forward (right) one word
  Ctrl + k            Delete the sentence after the cursor
  Ctrl + u            Delete the sentence before the cursor
  Ctrl + w            Delete the word before the cursor

  Ctrl + l            Clear the screen
  Ctrl + c            Stop the model from responding
  Ctrl + d            Exit corral (/bye)
"""

_TRUE = ("1", "t", "T", "TRUE", "true", "True")  # Go's strconv.ParseBool
_FALSE = ("0", "f", "F", "FALSE", "false", "False")


def parameter_value(name: str, values: list[str]) -> Any:
    """A `/set parameter` value typed as Ollama's api.FormatParams types it; ValueError with
    Ollama's message for an unknown name or a value of the wrong type."""
    opt = REQUEST_OPTIONS.get(name)
    if opt is None:
        raise ValueError(f"unknown parameter '{name}'")
    kinds = opt.type if isinstance(opt.type, tuple) else (opt.type,)
    if list in kinds:  # stop: every word given
        return list(values)
    text = values[0]
    kind = kinds[0]
    try:
        if kind is bool:
            if text not in _TRUE + _FALSE:
                raise ValueError
            return text in _TRUE
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError:
        raise ValueError(f"invalid {kind.__name__} value [{' '.join(values)}]") from None
    return text


def go_value(v: Any) -> str:
    """A value as Go's %v prints it (`[a b]` for a list, `1` for 1.0, `true`)."""
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else repr(v)
    if isinstance(v, list):
        return "[" + " ".join(go_value(x) for x in v) + "]"
    return str(v)


def _quoted(text: str) -> str:
    return f'"""{text}"""'


def read_message(read: Callable[[str], str]) -> str:
    """One entry: text between triple quotes may span lines, as a message or after
    `/set system`, as in ollama; the quotes stay for the caller to strip."""
    line = read(">>> ")
    head, quoted = "", line
    if line.startswith("/set system "):
        head, quoted = "/set system ", line[len("/set system ") :].lstrip()
    if not quoted.startswith('"""') or (len(quoted) > 3 and quoted.rstrip().endswith('"""')):
        return line
    parts = [quoted]
    while True:
        nxt = read("... ")
        parts.append(nxt)
        if nxt.rstrip().endswith('"""'):
            return head + "\n".join(parts)


def unquote(text: str) -> str:
    """Text without the triple quotes around it (and the newlines just inside them)."""
    if text.startswith('"""'):
        text = text[3:]
        if text.rstrip().endswith('"""'):
            text = text.rstrip()[:-3]
        return text.strip("\n")
    return text


def hinted_input(prompt: str) -> str:
    """input() (GNU readline's editing and history) with Ollama's hint shown dimmed in the
    empty line: the first key is read raw, the hint wiped, and the key handed to readline."""
    import readline

    if prompt != ">>> ":  # a message's second line on: no hint, as in Ollama
        return input(prompt)
    fd = sys.stdin.fileno()
    old = termios.tcgetattr(fd)
    try:
        # raw before the hint is drawn, so that no key typed after it is echoed by the terminal
        tty.setraw(fd, termios.TCSANOW)
        sys.stdout.write(f"{prompt}\x1b[2m{HINT}\x1b[0m\x1b[{len(HINT)}D")
        sys.stdout.flush()
        key = os.read(fd, 1)
        # the rest of an escape sequence or a multi-byte character, sent with its first byte
        while (key[:1] == b"\x1b" or key[0] >= 0xC0) and len(key) < 8:
            if not select.select([fd], [], [], 0.02)[0]:
                break
            key += os.read(fd, 1)
            if key[0] >= 0xC0:
                with contextlib.suppress(UnicodeDecodeError):
                    key.decode()
                    break
            elif len(key) > 2 and (key[-1:].isalpha() or key[-1:] == b"~"):
                break
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, old)
    sys.stdout.write("\r\x1b[K")
    sys.stdout.flush()
    if key == b"\x04":
        raise EOFError
    if key == b"\x03":
        raise KeyboardInterrupt
    if key in (b"\r", b"\n"):
        print(prompt)
        return ""
    prefill = ""
    if key in (b"\x1b[A", b"\x1bOA"):  # up: the last entry, as readline's history would
        prefill = readline.get_history_item(readline.get_current_history_length()) or ""
    elif not key.startswith(b"\x1b"):
        prefill = key.decode(errors="ignore")
        prefill = prefill if prefill.isprintable() else ""
    readline.set_startup_hook(lambda: readline.insert_text(prefill))
    try:
        return input(prompt)
    finally:
        readline.set_startup_hook(None)


def default_reader() -> Callable[[str], str]:
    """hinted_input on a real terminal with GNU readline, else input()."""
    try:
        import readline  # noqa: F401  (line editing and history for input())

        real_tty = os.isatty(sys.stdin.fileno()) and os.isatty(sys.stdout.fileno())
    except (ImportError, OSError, ValueError):
        return input
    return hinted_input if real_tty else input


@dataclass
class Session:
    """What a chat carries from one message to the next, and what /save keeps."""

    model: str
    verbose: bool = False
    wrap: int | None = None  # the terminal's width; None: no word wrap
    wordwrap: bool = True
    system: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    format: str = ""
    think: bool | str | None = None
    keep_alive: Any = None
    history: list[JSON] = field(default_factory=list)  # the user's and the model's turns
    nohistory: bool = False

    def messages(self) -> list[JSON]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.history]

    def chat_body(self) -> JSON:
        body: JSON = {"model": self.model, "messages": self.messages(), "stream": True}
        if self.options:
            body["options"] = dict(self.options)
        if self.format:
            body["format"] = self.format
        if self.think is not None:
            body["think"] = self.think
        if self.keep_alive is not None:
            body["keep_alive"] = self.keep_alive
        return body

    def create_body(self, name: str) -> JSON:
        """/save: a model made from this one with the session's system prompt, parameters and
        turns, as Ollama's NewCreateRequest makes it (the system prompt as `system`)."""
        body: JSON = {"model": name, "from": self.model, "stream": True}
        if self.system:
            body["system"] = self.system
        if self.options:
            body["parameters"] = dict(self.options)
        if self.history:
            body["messages"] = list(self.history)
        return body


class Repl:
    """The loop and its commands; output goes where Ollama's goes (help to stderr)."""

    def __init__(self, client: Client, session: Session, read: Callable[[str], str]) -> None:
        self.client = client
        self.s = session
        self.read = read
        self.printer = TokenPrinter(sys.stdout, session.wrap)
        self.spin = _isatty(sys.stderr)

    def run(self) -> int:
        while True:
            try:
                text = read_message(self.read)
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print("\nUse Ctrl + d or /bye to exit.")
                continue
            if self.s.nohistory:
                self._forget_line()
            if not text.strip():
                continue
            if text.startswith("/"):
                if self.command(text) == "bye":
                    return 0
                continue
            self.send(unquote(text))

    def _forget_line(self) -> None:
        with contextlib.suppress(ImportError, ValueError):
            import readline

            n = readline.get_current_history_length()
            if n:
                readline.remove_history_item(n - 1)

    # ---- a message -----------------------------------------------------------------------
    def send(self, text: str) -> None:
        self.s.history.append({"role": "user", "content": text})
        self.printer.limit = (self.s.wrap - 1) if self.s.wrap and self.s.wordwrap else 0
        try:
            reply, final = stream_reply(
                self.client, "/api/chat", self.s.chat_body(), self.printer, self.spin
            )
        except KeyboardInterrupt:  # stop this answer; forget the unanswered question
            self.s.history.pop()
            self.printer.end_line()
            print()
            return
        except Unreachable:
            raise
        except CLIError as e:  # keep the session; the server may accept the next message
            self.s.history.pop()
            self.printer.end_line()
            print(f"Error: {e}", file=sys.stderr)
            return
        self.s.history.append({"role": "assistant", "content": reply})
        self.printer.end_line()
        print()
        if self.s.verbose:
            print_stats(final)

    # ---- commands ------------------------------------------------------------------------
    def command(self, line: str) -> str | None:
        args = line.split()
        name = args[0]
        if name in ("/bye", "/exit"):
            return "bye"
        if name == "/clear":
            self.s.history.clear()
            print("Cleared session context")
        elif name == "/set":
            self.set(args[1:], line)
        elif name == "/unset":
            self.unset(args[1:])
        elif name == "/show":
            self.show(args[1:])
        elif name == "/load":
            self.load(args[1:])
        elif name == "/save":
            self.save(args[1:])
        elif name in ("/?", "/help"):
            topic = args[1] if len(args) > 1 else ""
            text = {"set": USAGE_SET, "/set": USAGE_SET, "show": USAGE_SHOW,
                    "/show": USAGE_SHOW, "shortcut": USAGE_SHORTCUTS,
                    "shortcuts": USAGE_SHORTCUTS}.get(topic, USAGE)  # fmt: skip
            print(text, file=sys.stderr)
        else:
            print(f"Unknown command '{name}'. Type /? for help")
        return None

    def set(self, args: list[str], line: str) -> None:
        if not args:
            print(USAGE_SET, file=sys.stderr)
            return
        what, s = args[0], self.s
        if what == "history":
            s.nohistory = False
        elif what == "nohistory":
            s.nohistory = True
        elif what in ("wordwrap", "nowordwrap"):
            s.wordwrap = what == "wordwrap"
            print(f"Set '{what}' mode.")
        elif what in ("verbose", "quiet"):
            s.verbose = what == "verbose"
            print(f"Set '{what}' mode.")
        elif what == "think":
            s.think = args[1] if len(args) > 1 else True
            print(f"Set 'think' mode to '{args[1]}'." if len(args) > 1 else "Set 'think' mode.")
        elif what == "nothink":
            s.think = False
            print("Set 'nothink' mode.")
        elif what == "format":
            if len(args) < 2 or args[1] != "json":
                print("Invalid or missing format. For 'json' mode use '/set format json'")
            else:
                s.format = "json"
                print("Set format to 'json' mode.")
        elif what == "noformat":
            s.format = ""
            print("Disabled format.")
        elif what == "parameter":
            if len(args) < 3:
                print(USAGE_PARAMETERS, file=sys.stderr)
                return
            try:
                value = parameter_value(args[1], args[2:])
            except ValueError as e:
                print(f'Couldn\'t set parameter: "{e}"')
                return
            print(f"Set parameter '{args[1]}' to '{', '.join(args[2:])}'")
            s.options[args[1]] = value
        elif what == "system":
            if len(args) < 2:
                print(USAGE_SET, file=sys.stderr)
                return
            s.system = unquote(line.split(None, 2)[2].strip())
            print("Set system message.")
        else:
            print(f"Unknown command '/set {what}'. Type /? for help")

    def unset(self, args: list[str]) -> None:
        what = args[0] if args else ""
        if what == "format":
            self.s.format = ""
            print("Disabled format.")
        elif what == "system":
            self.s.system = ""
            print("Cleared system message.")
        elif what == "parameter" and len(args) > 1:
            self.s.options.pop(args[1], None)
            print(f"Unset parameter '{args[1]}'.")
        else:
            print(f"Unknown command '/unset {' '.join(args)}'. Type /? for help")

    def show(self, args: list[str]) -> None:
        if not args:
            print(USAGE_SHOW, file=sys.stderr)
            return
        what = args[0]
        if what not in ("info", "license", "modelfile", "parameters", "system", "template"):
            print(f"Unknown command '/show {what}'. Type /? for help")
            return
        try:
            info = self.client.post("/api/show", {"model": self.s.model})
        except CLIError as e:
            print(f"error: couldn't get model: {e}")
            return
        if what == "info":
            print(format_show(info), file=sys.stderr)
        elif what == "license":
            print(info.get("license") or "No license was specified for this model.")
        elif what == "modelfile":
            print(self.modelfile(str(info.get("modelfile") or "")))
        elif what == "parameters":
            print("Model defined parameters:")
            own = str(info.get("parameters") or "")
            if not own:
                print("  No additional parameters were specified for this model.")
            for row in own.splitlines() if own else ():
                print(f"  {row}")
            print()
            if self.s.options:
                print("User defined parameters:")
                for k, v in self.s.options.items():
                    print(f"  {k:<30} {go_value(v)}")
                print()
        elif what == "system":
            text = self.s.system or str(info.get("system") or "")
            print(text + "\n" if text else "No system message was specified for this model.")
        elif what == "template":
            print(info.get("template") or "No prompt template was specified for this model.")

    def modelfile(self, text: str) -> str:
        """The model's Modelfile with the session's system prompt and parameters after its
        own (a later line wins), as /save would make it."""
        lines = [text.rstrip("\n")] if text else []
        if self.s.system:
            lines.append(f"SYSTEM {_quoted(self.s.system)}")
        for k, v in self.s.options.items():
            for item in v if isinstance(v, list) else [v]:
                shown = f'"{item}"' if isinstance(item, str) else go_value(item)
                lines.append(f"PARAMETER {k} {shown}")
        return "\n".join(lines)

    def load(self, args: list[str]) -> None:
        if len(args) != 1:
            print("Usage:\n  /load <modelname>")
            return
        print(f"Loading model '{args[0]}'")
        try:
            load_model(self.client, args[0], self.s.keep_alive)
        except Unreachable:
            raise
        except CLIError as e:
            if e.status == 404:
                print(f"Couldn't find model '{args[0]}'")
            else:
                print(f"error: {e}")
            return
        self.s.model = args[0]
        self.s.history.clear()

    def save(self, args: list[str]) -> None:
        if len(args) != 1:
            print("Usage:\n  /save <modelname>")
            return
        try:
            for _ in self.client.stream("/api/create", self.s.create_body(args[0])):
                pass
        except Unreachable:
            raise
        except CLIError as e:
            if e.status == 400 and "name" in str(e):
                print(f"error: The model name '{args[0]}' is invalid")
            else:
                print(f"error: {e}")
            return
        print(f"Created new model '{args[0]}'")


def chat_loop(client: Client, session: Session, read: Callable[[str], str] | None = None) -> int:
    return Repl(client, session, read or default_reader()).run()
