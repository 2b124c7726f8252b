"""Secret redaction for the command lines gpuwatch shows (CLI, exporter labels, logs, alerts),
and for the values of the few environment variables it keeps (`redact_env`: MASTER_ADDR may be
a URL with a password in it).

Command lines on GPU nodes carry credentials more often than one would hope:
`huggingface-cli login --token hf_...`, `env WANDB_API_KEY=... torchrun ...`,
`sh -c "HF_TOKEN=... python train.py"`, database URLs with passwords, presigned S3 URLs.

Three kinds of evidence, from strongest to weakest:

* the name: a flag or KEY=VALUE whose name says it holds a secret (`--hf-token X`,
  `--api_key=X`, `AWS_SECRET_ACCESS_KEY=X`); the name stays, the value becomes `***`;
* the place: the password of a URL's user info, an Authorization header, a presigned URL's
  signature;
* the shape: token formats that are unambiguous wherever they appear (`hf_...`, `ghp_...`,
  `AKIA...`, JWTs); the vendor prefix stays so the reader knows what kind of token it was.

Arguments that hold no secret must come back unchanged: command lines are how people recognise
their jobs, so the name rules are deliberately narrow (`--max-new-tokens`, `--pad-token "<pad>"`,
`--text-key content` and `TOKENIZERS_PARALLELISM=false` are common and not secrets).

Short flags are not redacted by name: `-p` is a port for ssh and uvicorn, a PID for py-spy, a
password only for a few tools. Those few are handled by program name (_SHORT_FLAG_TOOLS). For any
other program, the value of a bare `-p`/`-P` is masked only when it is shaped like a password
(upper and lower case letters and a digit, no path, no port map): ports, PIDs, directories and
regular expressions stay, `-p pSECRET9` does not.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

MASK = "***"

# -- names ------------------------------------------------------------------------------------

# A token that is a secret wherever it appears in a name: PASSWORD, PGPASSWORD, CLIENT_SECRET.
_STRONG_TOKEN = re.compile(r"[a-z0-9]*(?:password|passwd|passphrase|secret)")
# Tokens that make a name secret only as its last word: HF_TOKEN, --auth, but not
# HF_TOKEN_PATH or AUTH_TYPE (those name where or how the secret is, not the secret).
_WEAK_LAST = frozenset({"token", "auth", "authorization", "credential", "credentials", "pwd",
                        "apikey", "accesskey", "secretkey", "privatekey", "authkey"})
_WEAK_LAST_SUFFIXES = ("token", "apikey")  # authtoken, accesstoken, hftoken, openaiapikey
# "key" alone is too common a word in training command lines (--text-key, --label_key,
# --chosen_key, data.prompt_key=...), so it needs a qualifier that makes it a credential.
_KEY_QUALIFIERS = frozenset({
    "api", "access", "secret", "private", "auth", "wandb", "license", "encryption", "signing",
    "master", "ssh", "client", "account", "storage", "subscription", "hmac", "jwt", "session",
    "openai", "anthropic", "ngc", "kaggle", "comet",
})
# Tokenizer settings that end in "token" and hold a vocabulary entry or a count, not a
# credential. Ambiguous words (user, system, session) are left out: a leak costs more than a
# masked "<|user|>".
_TOKENIZER_QUALIFIERS = frozenset({
    "pad", "eos", "bos", "unk", "sep", "cls", "mask", "eot", "eom", "special", "start", "end",
    "stop", "image", "video", "audio", "think", "placeholder", "ignore", "max", "min", "num",
    "fim", "middle",
})
# A last word that says the value points at the secret or describes it: --password-file,
# --token-path, AWS_ACCESS_KEY_ID, --secret-name, --api-key-env, --password-stdin.
_REFERENCE_SUFFIXES = frozenset({
    "file", "files", "filename", "path", "paths", "dir", "directory", "name", "names", "id",
    "ids", "type", "env", "var", "mode", "url", "uri", "endpoint", "host", "length", "len",
    "size", "count", "limit", "ttl", "expiry", "expiration", "header", "field", "column",
    "prefix", "suffix", "format", "kind", "version", "provider", "source", "backend",
    "location", "stdin",
})
# First words that make a flag a switch: --no-password, --use_auth_token, --ask-password take no
# value, so the next argument is not theirs.
_SWITCH_VERBS = frozenset({
    "no", "disable", "enable", "use", "skip", "require", "requires", "allow", "ask", "with",
    "without", "ignore", "show", "hide", "print", "prompt", "trust", "save", "add",
})
_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NAME_SEPARATORS = re.compile(r"[-_.:/]+")


def _name_tokens(name: str) -> list[str]:
    name = _CAMEL_BOUNDARY.sub("-", name.lstrip("-+~"))
    return [t for t in _NAME_SEPARATORS.split(name.lower()) if t]


def _is_secret_name(name: str) -> bool:
    tokens = _name_tokens(name)
    if not tokens:
        return False
    last = tokens[-1]
    if last in _REFERENCE_SUFFIXES:
        return False
    if any(_STRONG_TOKEN.fullmatch(t) for t in tokens):
        return True
    if last in _WEAK_LAST or last.endswith(_WEAK_LAST_SUFFIXES):
        if last == "token" and len(tokens) > 1 and tokens[-2] in _TOKENIZER_QUALIFIERS:
            return False
        # PWD alone is the working directory; MYSQL_PWD is a password.
        return not (last == "pwd" and len(tokens) == 1)
    if len(tokens) == 1 and last in _ALONE:
        return True
    return last == "key" and len(tokens) > 1 and tokens[-2] in _KEY_QUALIFIERS


# Words that are a secret's name only alone: `--key X`, `--pass X`, openssl's `-passin pass:X`
# (but `--text-key`, `--first-pass`, `--pw-file` are something else).
_ALONE = frozenset({"key", "pass", "passin", "passout", "pw", "passwd", "psw"})


def _is_switch(name: str) -> bool:
    tokens = _name_tokens(name)
    return bool(tokens) and tokens[0] in _SWITCH_VERBS


# -- values ----------------------------------------------------------------------------------

# Values that cannot be a secret, shown as they are: switches given a value (--use_auth_token
# True), stdin ("-"), a shell variable not yet expanded (`--token $HF_TOKEN` inside `sh -c`), and
# tokenizer vocabulary ("<pad>", "<|endoftext|>", "[PAD]").
_LITERALS = frozenset({"", "true", "false", "yes", "no", "on", "off", "none", "null", "0", "1",
                       "-", MASK})
_NOT_SECRET_VALUE = re.compile(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?|<[^<>\s]*>|\[[A-Z_]+\]")
# Inside a shell string the value's quotes and the command separator after it are shell syntax.
_SHELL_VALUE = re.compile(r"(['\"]?)(.*?)(['\"]?[;&|)]*)", re.DOTALL)


def _mask_value(value: str, shell: bool) -> str:
    prefix, inner, suffix = "", value, ""
    if shell:
        match = _SHELL_VALUE.fullmatch(value)
        if match:
            prefix, inner, suffix = match.groups()
    if inner.lower() in _LITERALS or _NOT_SECRET_VALUE.fullmatch(inner):
        return value
    return f"{prefix}{MASK}{suffix}"


# -- words -----------------------------------------------------------------------------------

# What the next argument looks like when it is another option rather than a value.
_FLAG_LIKE = re.compile(r"--?[A-Za-z][A-Za-z0-9_.\-]*(?:=.*)?|--", re.DOTALL)
# KEY=VALUE names: environment variables (env, docker -e), Hydra overrides (+a.b.api_key=...).
_ASSIGNMENT_NAME = re.compile(r"[+~]{0,2}[A-Za-z_][A-Za-z0-9_.\-]*")

# Tools where a short flag is a password: flag -> whether it takes the next argument as its value
# (mysql's `-p` alone prompts, and the next argument is the database).
_SHORT_FLAG_TOOLS: dict[str, dict[str, bool]] = {
    "sshpass": {"-p": True},
    "redis-cli": {"-a": True},
    "valkey-cli": {"-a": True},
    "keydb-cli": {"-a": True},
    "mysql": {"-p": False},
    "mysqldump": {"-p": False},
    "mysqladmin": {"-p": False},
    "mariadb": {"-p": False},
    "mariadb-dump": {"-p": False},
    "mongo": {"-p": True},
    "mongosh": {"-p": True},
    "mongodump": {"-p": True},
    "mongorestore": {"-p": True},
    "mongoexport": {"-p": True},
    "mongoimport": {"-p": True},
    "rabbitmqadmin": {"-p": True},
    "racadm": {"-p": True},
    "ipmitool": {"-P": True},
    "sqlcmd": {"-P": True},
    "bcp": {"-P": True},
    "zip": {"-P": True},
    "unzip": {"-P": True},
    "7z": {"-p": False},
    "7za": {"-p": False},
    "mosquitto_pub": {"-P": True},
    "mosquitto_sub": {"-P": True},
    "ldapsearch": {"-w": True},
    "ldapadd": {"-w": True},
    "ldapmodify": {"-w": True},
    "ldapdelete": {"-w": True},
    "ldapwhoami": {"-w": True},
    "ldappasswd": {"-w": True, "-s": True},
    "openssl": {"-k": True},
}
# Flags whose value is `user:password` (curl) or `user%password` (smbclient): the user stays.
_USER_PASSWORD_FLAGS: dict[str, tuple[frozenset[str], str]] = {
    "curl": (frozenset({"-u", "--user", "--proxy-user", "-U"}), ":"),
    "smbclient": (frozenset({"-U", "--user"}), "%"),
    "rpcclient": (frozenset({"-U", "--user"}), "%"),
}
# The short flags that are a password often enough that, for a program not listed above, a
# value shaped like a password is masked (see _password_shaped).
_GUESSED_PASSWORD_FLAGS = frozenset({"-p", "-P"})
# Registry clients: `docker login -p PASSWORD` (while `docker run -p 8080:80` is a port).
_LOGIN_TOOLS = frozenset({"docker", "podman", "nerdctl", "buildah", "skopeo", "oras", "helm"})
_LOGIN_PASSWORD_FLAG = "-p"
# Tools whose first positional argument is the command they run.
_WRAPPERS = frozenset({"sshpass"})


class _Program:
    """Which program the words belong to, for the short-flag exceptions."""

    def __init__(self, first_word: str) -> None:
        self.name = _basename(first_word)
        self.login = False

    def see(self, word: str) -> None:
        """Note a positional word (not an option, not an option's value)."""
        name = _basename(word)
        # `sudo sshpass ...`, `env X=1 mysql ...` switch to the tool; after a wrapper the word is
        # the wrapped command (sshpass -p X ssh -p 2222: the second -p is ssh's port).
        if (name in _SHORT_FLAG_TOOLS or name in _LOGIN_TOOLS or name in _USER_PASSWORD_FLAGS
                or self.name in _WRAPPERS):
            self.name = name
            self.login = False
        elif word == "login":
            self.login = True

    def password_flag(self, flag: str) -> Optional[bool]:
        """None: not a password flag here; else whether it takes the next word as its value."""
        if flag in _SHORT_FLAG_TOOLS.get(self.name, {}):
            return _SHORT_FLAG_TOOLS[self.name][flag]
        if self.name in _LOGIN_TOOLS and self.login and flag == _LOGIN_PASSWORD_FLAG:
            return True
        return None

    def user_password_flag(self, flag: str) -> Optional[str]:
        """The separator of `user<sep>password` when `flag` takes such a value here, else None."""
        known = _USER_PASSWORD_FLAGS.get(self.name)
        return known[1] if known is not None and flag in known[0] else None

    def guesses(self, flag: str) -> bool:
        """Whether a password-shaped value of `flag` is masked: a program with its own list of
        short password flags is trusted to have it complete."""
        return (flag in _GUESSED_PASSWORD_FLAGS and self.name not in _SHORT_FLAG_TOOLS
                and not (self.name in _LOGIN_TOOLS and self.login))


# Ports, PIDs, port maps, paths, patterns, counts and lower-case names are not; `pSECRET9`,
# `Hunter2!` are.
_PASSWORDISH = re.compile(r"[^\s/:.,]{6,}")


def _password_shaped(value: str) -> bool:
    if not _PASSWORDISH.fullmatch(value) or value.startswith(("$", "-")):
        return False
    has_digit = any(c.isdigit() for c in value)
    return has_digit and any(c.isupper() for c in value) and any(c.islower() for c in value)


def _mask_user_password(value: str, sep: str, shell: bool) -> str:
    user, found, password = value.partition(sep)
    if not found or not password:
        return value
    return f"{user}{sep}{_mask_value(password, shell)}"


def _basename(word: str) -> str:
    return word.strip("'\"").rsplit("/", 1)[-1]


def _redact_words(words: list[str], shell: bool) -> list[str]:
    program = _Program(next((w for w in words if w), ""))
    out: list[str] = []
    wants_value = False
    for i, word in enumerate(words):
        previous = words[i - 1] if i > 0 else ""
        if wants_value:
            wants_value = False
            if not _FLAG_LIKE.fullmatch(word):
                out.append(_redact_inline(_mask_value(word, shell)))
                continue
        elif i > 0 and not _FLAG_LIKE.fullmatch(word):
            sep = program.user_password_flag(previous)
            if sep is not None:
                out.append(_redact_inline(_mask_user_password(word, sep, shell)))
                continue
            if program.guesses(previous) and _password_shaped(word):
                out.append(_mask_value(word, shell))
                continue
        if i > 0 and not word.startswith("-"):
            program.see(word)
        if not shell and _is_shell_string(word):
            out.append(_redact_shell_string(word))
            continue
        redacted, wants_value = _redact_word(word, program, shell)
        out.append(_redact_inline(redacted))
    return out


# What str.isspace() calls whitespace (both ask Py_UNICODE_ISSPACE), found without a loop.
_SPACE = re.compile(r"\s")


def _is_shell_string(word: str) -> bool:
    # `sh -c "HF_TOKEN=x python train.py"`, a setproctitle'd command line in one argument. A
    # single `--flag=value with spaces` argument is one option, not a script.
    if not _SPACE.search(word):
        return False
    return not (word.startswith("-") and "=" in word and
                not _SPACE.search(word.split("=", 1)[0]))


def _redact_shell_string(text: str) -> str:
    text = _redact_inline(text)  # JSON pairs and headers span words: match them whole first
    parts = re.split(r"(\s+)", text)
    words = _redact_words(parts[0::2], shell=True)
    parts[0::2] = words
    return "".join(parts)


def _redact_word(word: str, program: _Program, shell: bool) -> tuple[str, bool]:
    """The word redacted, and whether the next word is this one's secret value."""
    if word.startswith("-") and len(word) > 1 and word != "--":
        name, eq, value = word.partition("=")
        flag = name.lstrip("-")
        if len(name) - len(flag) == 1:  # a short flag, or a cluster like -psecret
            takes_next = program.password_flag(name[:2])
            if takes_next is not None:
                if len(name) > 2:
                    return name[:2] + _mask_value(name[2:], shell), False
                if eq:
                    return f"{name}={_mask_value(value, shell)}", False
                return word, takes_next
            if len(flag) == 1:
                return (f"{name}={_redact_assignment(value, shell)}" if eq else word), False
        if _is_secret_name(flag):
            if eq:
                return f"{name}={_mask_value(value, shell)}", False
            return word, not _is_switch(flag)
        if eq:  # --env=HF_TOKEN=..., --build-arg=..., -Dspring.datasource.url=...
            return f"{name}={_redact_assignment(value, shell)}", False
        return word, False
    return _redact_assignment(word, shell), False


def _redact_assignment(word: str, shell: bool) -> str:
    name, eq, value = word.partition("=")
    if eq and _ASSIGNMENT_NAME.fullmatch(name) and _is_secret_name(name):
        return f"{name}={_mask_value(value, shell)}"
    return word


# -- places and shapes -----------------------------------------------------------------------

# scheme://user:password@host — the user info ends at the last "@" before the host (passwords
# with an unescaped "@" exist), but never crosses "/", "," (multi-host URIs) or whitespace.
# Schemes are anchored at a word start and bounded in length: a scheme pattern tried at every
# position of a long run of letters would otherwise take quadratic time.
_SCHEME = r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]{0,31}://"
_URL_USERINFO = re.compile(rf"(?P<scheme>{_SCHEME})(?P<userinfo>[^\s/?#,'\"<>]*)@")
_URL = re.compile(rf"{_SCHEME}[^\s'\"<>]*")
_QUERY_PARAM = re.compile(r"(?P<lead>[?&](?P<name>[A-Za-z0-9_.\-]+)=)(?P<value>[^&#\s'\"]*)")
# Presigned-URL signatures grant access as a password does, under names that do not say so.
_SECRET_QUERY_PARAMS = frozenset({
    "sig", "signature", "x-amz-signature", "x-amz-security-token", "x-amz-credential",
    "x-goog-signature", "x-goog-credential",
})
# "api_key": "abc" inside inline JSON or Python dict arguments.
_QUOTED_PAIR = re.compile(
    r"(?P<lead>(?P<q>[\"'])(?P<name>[A-Za-z0-9_.\-]+)(?P=q)\s*:\s*(?P<vq>[\"']))"
    r"(?P<value>[^\"'\\]*)(?P=vq)")
_AUTH_HEADER = re.compile(
    r"(?i)(?P<lead>authorization:\s*(?:bearer|basic|token)\s+)(?P<value>[^\s'\"]+)")
_BEARER = re.compile(r"(?i)(?P<lead>\bbearer\s+)(?P<value>[A-Za-z0-9._~+/\-]{16,}=*)")


def _mixed(token: str) -> bool:
    # Random keys mix cases and digits; run names and identifiers with the same prefix
    # ("sk-resnet50-finetune-bs256") are lower case.
    return (any(c.isupper() for c in token) and any(c.islower() for c in token)
            and any(c.isdigit() for c in token))


def _has_upper_and_lower(token: str) -> bool:
    return any(c.isupper() for c in token) and any(c.islower() for c in token)


# (pattern with the kept prefix as group 1 (empty for JWTs), extra check on the whole match)
_SHAPES: tuple[tuple[re.Pattern[str], Optional[Callable[[str], bool]]], ...] = (
    # Hugging Face user access tokens: hf_ + 34 letters and digits.
    (re.compile(r"(?<![A-Za-z0-9_])(hf_)[A-Za-z0-9]{30,}"), _has_upper_and_lower),
    # GitHub personal, OAuth, user-to-server, server-to-server, refresh; fine-grained PATs.
    (re.compile(r"(?<![A-Za-z0-9_])((?:ghp|gho|ghu|ghs|ghr)_)[A-Za-z0-9]{36,}"), None),
    (re.compile(r"(?<![A-Za-z0-9_])(github_pat_)[A-Za-z0-9_]{22,}"), None),
    # GitLab personal access tokens.
    (re.compile(r"(?<![A-Za-z0-9_\-])(glpat-)[A-Za-z0-9_\-]{20,}"), None),
    # OpenAI (sk-, sk-proj-) and Anthropic (sk-ant-) API keys.
    (re.compile(r"(?<![A-Za-z0-9_\-])(sk-)[A-Za-z0-9_\-]{32,}"), _mixed),
    # Slack bot, user, app-level, refresh tokens.
    (re.compile(r"(?<![A-Za-z0-9])(xox[abposre]-)[A-Za-z0-9\-]{10,}"), None),
    (re.compile(r"(?<![A-Za-z0-9])(xapp-)[A-Za-z0-9\-]{10,}"), None),
    # Stripe secret and restricted keys (pk_ keys are public).
    (re.compile(r"(?<![A-Za-z0-9_])((?:sk|rk)_(?:live|test)_)[A-Za-z0-9]{16,}"), None),
    # NVIDIA NGC / build.nvidia.com, Groq, Replicate, Grafana Cloud.
    (re.compile(r"(?<![A-Za-z0-9_\-])(nvapi-)[A-Za-z0-9_\-]{32,}"), None),
    (re.compile(r"(?<![A-Za-z0-9_])(gsk_)[A-Za-z0-9]{32,}"), _mixed),
    (re.compile(r"(?<![A-Za-z0-9_])(r8_)[A-Za-z0-9]{30,}"), _mixed),
    (re.compile(r"(?<![A-Za-z0-9_])(glc_)[A-Za-z0-9+/]{32,}=*"), None),
    # AWS access key ids, long-term (AKIA) and temporary (ASIA).
    (re.compile(r"(?<![A-Z0-9])(AKIA|ASIA)[A-Z0-9]{16}(?![A-Z0-9])"), None),
    # Google API keys.
    (re.compile(r"(?<![A-Za-z0-9_\-])(AIza)[A-Za-z0-9_\-]{35}(?![A-Za-z0-9_\-])"), None),
    # npm and PyPI upload tokens.
    (re.compile(r"(?<![A-Za-z0-9_])(npm_)[A-Za-z0-9]{36}(?![A-Za-z0-9])"), None),
    (re.compile(r"(?<![A-Za-z0-9_\-])(pypi-)AgEIcHlwaS5vcmc[A-Za-z0-9_\-]{20,}"), None),
    # JWTs: base64url '{"' header and payload; the signature may be empty (alg "none").
    (re.compile(r"(?<![A-Za-z0-9_\-])()eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*"),
     None),
)

# The literal each shape starts with: most words hold none, and one search over the text costs
# a tenth of trying every shape on it.
_SHAPE_PREFIX = re.compile(r"hf_|gh[opusr]_|github_pat_|glpat-|sk-|xox[abposre]-|xapp-|AKIA|"
                           r"ASIA|AIza|npm_|pypi-|eyJ|[sr]k_(?:live|test)_|nvapi-|gsk_|r8_|glc_")


def _redact_inline(text: str) -> str:
    if "://" in text:
        text = _URL_USERINFO.sub(_userinfo_repl, text)
        if "=" in text:
            text = _URL.sub(lambda m: _QUERY_PARAM.sub(_query_repl, m.group(0)), text)
    if ":" in text and ("'" in text or '"' in text):
        text = _QUOTED_PAIR.sub(_quoted_pair_repl, text)
    lowered = text.lower()
    if "bearer" in lowered or "authorization" in lowered:
        text = _AUTH_HEADER.sub(lambda m: m.group("lead") + MASK, text)
        text = _BEARER.sub(lambda m: m.group("lead") + MASK, text)
    if _SHAPE_PREFIX.search(text):
        for pattern, check in _SHAPES:
            text = pattern.sub(lambda m, check=check: _shape_repl(m, check), text)
    return text


def _userinfo_repl(match: re.Match[str]) -> str:
    user, colon, password = match.group("userinfo").partition(":")
    if not colon or not password or password == MASK:
        return match.group(0)
    return f"{match.group('scheme')}{user}:{MASK}@"


def _query_repl(match: re.Match[str]) -> str:
    name, value = match.group("name"), match.group("value")
    if value and (name.lower() in _SECRET_QUERY_PARAMS or _is_secret_name(name)):
        return match.group("lead") + _mask_value(value, shell=False)
    return match.group(0)


def _quoted_pair_repl(match: re.Match[str]) -> str:
    if not _is_secret_name(match.group("name")):
        return match.group(0)
    masked = _mask_value(match.group("value"), shell=False)
    return f"{match.group('lead')}{masked}{match.group('vq')}"


def _shape_repl(match: re.Match[str], check: Optional[Callable[[str], bool]]) -> str:
    if check is not None and not check(match.group(0)):
        return match.group(0)
    return match.group(1) + MASK


# -- entry point -----------------------------------------------------------------------------

def redact_cmdline(argv: Sequence[str]) -> tuple[str, ...]:
    """`argv` with secrets replaced by `***`; arguments without secrets unchanged. Never raises."""
    try:
        if isinstance(argv, (str, bytes)):  # one string is one argument, not a list of letters
            argv = [argv]
        words = [_as_text(a) for a in argv]
    except Exception:  # an argv that cannot even be iterated: show nothing rather than fail
        return ()
    try:
        return tuple(_redact_words(words, shell=False))
    except Exception:
        # Fail closed: a command line shown half-redacted is a leak. The program alone is still
        # some help, when it is a plain path.
        if not words:
            return ()
        head = words[0] if _PLAIN_PROGRAM.fullmatch(words[0]) else MASK
        return (head,) + (MASK,) * (len(words) - 1)


_PLAIN_PROGRAM = re.compile(r"[A-Za-z0-9_./+\-]+")


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with secrets in its values replaced by `***`, by the rules for command lines (a URL's
    password, a token's shape, `--token X` or `API_KEY=X` inside a value); names are kept, and a
    secret-named variable's whole value is masked. Never raises: a value that cannot be checked
    is masked whole."""
    out: dict[str, str] = {}
    for name, value in env.items():
        try:
            text = _as_text(value)
            if _is_secret_name(name):
                out[name] = _mask_value(text, shell=False)
            else:
                out[name] = _redact_words([text], shell=False)[0]
        except Exception:
            out[name] = MASK
    return out


def _as_text(arg: object) -> str:
    if isinstance(arg, str):
        return arg
    if isinstance(arg, (bytes, bytearray)):
        return bytes(arg).decode("utf-8", "replace")
    return str(arg)
