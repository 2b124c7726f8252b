"""Shell completion for `gpuwatch`: `--install-completion`, `--show-completion` and the answers
the installed scripts ask for.

The scripts and the protocol are the ones gpuwatch installed while its command line was built
with Typer (`_GPUWATCH_COMPLETE=complete_bash`, `_TYPER_COMPLETE_ARGS`), so a completion script
already in someone's ~/.bashrc, ~/.zfunc or fish directory keeps working unchanged. click does
the completing itself (commands, options, values); this module only speaks the protocol.
Imported only when completion is asked for: no other command pays for it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import click
from click.shell_completion import CompletionItem, ShellComplete, split_arg_string

from gpuwatch.sources.proc_stat import PPID, parse_stat

COMPLETE_VAR = "_GPUWATCH_COMPLETE"
SHELLS = ("bash", "zsh", "fish", "powershell", "pwsh")

_BASH = """\
%(complete_func)s() {
    local IFS=$'\\n'
    COMPREPLY=( $( env COMP_WORDS="${COMP_WORDS[*]}" \\
                   COMP_CWORD=$COMP_CWORD \\
                   %(autocomplete_var)s=complete_bash $1 ) )
    return 0
}

complete -o default -F %(complete_func)s %(prog_name)s"""

_ZSH = """\
#compdef %(prog_name)s

%(complete_func)s() {
  eval $(env _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" \
%(autocomplete_var)s=complete_zsh %(prog_name)s)
}

compdef %(complete_func)s %(prog_name)s"""

_FISH = (
    'complete --command %(prog_name)s --no-files --arguments "(env %(autocomplete_var)s='
    "complete_fish _TYPER_COMPLETE_FISH_ACTION=get-args _TYPER_COMPLETE_ARGS=(commandline -cp) "
    '%(prog_name)s)" --condition "env %(autocomplete_var)s=complete_fish '
    '_TYPER_COMPLETE_FISH_ACTION=is-args _TYPER_COMPLETE_ARGS=(commandline -cp) '
    '%(prog_name)s"')

_POWERSHELL = """\
Import-Module PSReadLine
Set-PSReadLineKeyHandler -Chord Tab -Function MenuComplete
$scriptblock = {
    param($wordToComplete, $commandAst, $cursorPosition)
    $Env:%(autocomplete_var)s = "complete_powershell"
    $Env:_TYPER_COMPLETE_ARGS = $commandAst.ToString()
    $Env:_TYPER_COMPLETE_WORD_TO_COMPLETE = $wordToComplete
    %(prog_name)s | ForEach-Object {
        $commandArray = $_ -Split ":::"
        $command = $commandArray[0]
        $helpString = $commandArray[1]
        [System.Management.Automation.CompletionResult]::new(
            $command, $command, 'ParameterValue', $helpString)
    }
    $Env:%(autocomplete_var)s = ""
    $Env:_TYPER_COMPLETE_ARGS = ""
    $Env:_TYPER_COMPLETE_WORD_TO_COMPLETE = ""
}
Register-ArgumentCompleter -Native -CommandName %(prog_name)s -ScriptBlock $scriptblock"""


class _Complete(ShellComplete):
    def get_completion_args(self) -> tuple[list[str], str]:
        """zsh's and fish's way: the command line so far in _TYPER_COMPLETE_ARGS, the word
        being completed last unless a space ends it."""
        line = os.environ.get("_TYPER_COMPLETE_ARGS", "")
        args = split_arg_string(line)[1:]
        if args and not line.endswith(" "):
            return args[:-1], args[-1]
        return args, ""

    def source_vars(self) -> dict[str, Any]:
        return {"complete_func": self.func_name, "autocomplete_var": self.complete_var,
                "prog_name": self.prog_name}

    def items(self) -> list[CompletionItem]:
        return self.get_completions(*self.get_completion_args())


class _Bash(_Complete):
    name = "bash"
    source_template = _BASH

    def get_completion_args(self) -> tuple[list[str], str]:
        words = split_arg_string(os.environ.get("COMP_WORDS", ""))
        cword = int(os.environ.get("COMP_CWORD", "0") or 0)
        return words[1:cword], words[cword] if cword < len(words) else ""

    def complete(self) -> str:
        return "\n".join(item.value for item in self.items())


class _Zsh(_Complete):
    name = "zsh"
    source_template = _ZSH

    def complete(self) -> str:
        def escape(s: str) -> str:
            return (s.replace('"', '""').replace("'", "''").replace("$", "\\$")
                    .replace("`", "\\`").replace(":", r"\\:"))

        shown = [f'"{escape(i.value)}":"{escape(i.help)}"' if i.help else f'"{escape(i.value)}"'
                 for i in self.items()]
        return "_arguments '*: :((" + "\n".join(shown) + "))'" if shown else "_files"


class _Fish(_Complete):
    name = "fish"
    source_template = _FISH

    def complete(self) -> str:
        shown = [f"{i.value}\t{_one_line(i.help)}" if i.help else i.value for i in self.items()]
        action = os.environ.get("_TYPER_COMPLETE_FISH_ACTION", "")
        if action == "is-args":
            # fish asks first whether to offer these at all (exit 0) or file names (exit 1).
            sys.exit(0 if shown else 1)
        return "\n".join(shown) if action == "get-args" else ""


def _one_line(text: str) -> str:
    return re.sub(r"\s", " ", text)


class _PowerShell(_Complete):
    name = "powershell"
    source_template = _POWERSHELL

    def get_completion_args(self) -> tuple[list[str], str]:
        incomplete = os.environ.get("_TYPER_COMPLETE_WORD_TO_COMPLETE", "")
        args = split_arg_string(os.environ.get("_TYPER_COMPLETE_ARGS", ""))
        return (args[1:-1] if incomplete else args[1:]), incomplete

    def complete(self) -> str:
        return "\n".join(f"{i.value}:::{i.help or ' '}" for i in self.items())


_CLASSES: dict[str, type[_Complete]] = {
    "bash": _Bash, "zsh": _Zsh, "fish": _Fish, "powershell": _PowerShell, "pwsh": _PowerShell}


def answer(cli: click.Command, prog_name: str, instruction: str) -> int:
    """What a completion script asked for in _GPUWATCH_COMPLETE: `complete_SHELL` or
    `source_SHELL` (click's own `SHELL_complete` order is understood too)."""
    first, _, second = instruction.partition("_")
    action, shell = (first, second) if first in ("complete", "source") else (second, first)
    cls = _CLASSES.get(shell)
    if cls is None:
        click.echo(f"Shell {shell or '?'} not supported.", err=True)
        return 1
    comp = cls(cli, {}, prog_name, COMPLETE_VAR)
    if action == "source":
        click.echo(comp.source())
    elif action == "complete":
        click.echo(comp.complete())
    else:
        click.echo(f'Completion instruction "{action}" not supported.', err=True)
        return 1
    return 0


def script(shell: str, prog_name: str = "gpuwatch") -> str:
    cls = _CLASSES.get(shell)
    if cls is None:
        raise click.UsageError(f"shell {shell!r} is not supported: {', '.join(SHELLS)}")
    return cls(click.Command(prog_name), {}, prog_name, COMPLETE_VAR).source()


def detect_shell() -> Optional[str]:
    """The shell this command was typed in: the nearest ancestor process that is one (a login
    shell's name starts with '-'), else $SHELL."""
    pid = os.getppid()
    for _ in range(16):
        if pid <= 1:
            break
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip().lstrip("-")
            stat = Path(f"/proc/{pid}/stat").read_bytes()
        except OSError:
            break
        name = {"powershell.exe": "powershell", "pwsh.exe": "pwsh"}.get(name, name)
        if name in _CLASSES:
            return name
        try:
            pid = int(parse_stat(stat)[1][PPID])
        except ValueError:
            break
    name = Path(os.environ.get("SHELL", "")).name
    return name if name in _CLASSES else None


def install(shell: str, prog_name: str = "gpuwatch") -> Path:
    """Install the script where each shell looks for it, as Typer did (the same files, so
    installing again replaces rather than adds)."""
    home = Path.home()
    text = script(shell, prog_name)
    if shell == "bash":
        path = home / ".bash_completions" / f"{prog_name}.sh"
        _add_lines(home / ".bashrc", [f"source '{path}'"])
    elif shell == "zsh":
        path = home / ".zfunc" / f"_{prog_name}"
        rc = home / ".zshrc"
        lines = ["fpath+=~/.zfunc; autoload -Uz compinit; compinit"]
        if "zstyle" not in (rc.read_text() if rc.is_file() else ""):
            lines.append("zstyle ':completion:*' menu select")
        _add_lines(rc, lines)
    elif shell == "fish":
        path = home / ".config" / "fish" / "completions" / f"{prog_name}.fish"
    else:
        profile = subprocess.run([shell, "-NoProfile", "-Command", "echo", "$profile"],
                                 check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
        path = Path(profile)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(text + "\n")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return path


def _add_lines(rc: Path, lines: list[str]) -> None:
    content = rc.read_text() if rc.is_file() else ""
    missing = [line for line in lines if line not in content]
    if missing:
        rc.parent.mkdir(parents=True, exist_ok=True)
        kept = content.rstrip("\n") + "\n\n" if content.strip() else ""
        rc.write_text(kept + "\n".join(missing) + "\n")


def _shell_of(value: str, param: click.Parameter) -> str:
    """The shell an option names, or else the one this is (a usage error where neither)."""
    shell = value or detect_shell()
    if not shell:
        raise click.UsageError("cannot tell which shell this is: name it, "
                               f"{param.opts[0]} SHELL ({', '.join(SHELLS)})")
    return shell


def install_option(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> None:
    if value is None or ctx.resilient_parsing:
        return
    shell = _shell_of(value, param)
    path = install(shell)
    click.secho(f"{shell} completion installed in {path}", fg="green")
    click.echo("Completion will take effect once you restart the terminal")
    ctx.exit(0)


def show_option(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> None:
    if value is None or ctx.resilient_parsing:
        return
    click.echo(script(_shell_of(value, param)))
    ctx.exit(0)
