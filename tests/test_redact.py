"""Secret redaction in command lines and in the launch environment: what is hidden, what is kept
byte for byte."""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from gpuwatch.simulate.fakenvml import FakeNode
from gpuwatch.sources.redact import MASK, redact_cmdline, redact_env

HF_TOKEN = "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"  # hf_ + 34 letters, mixed case
GH_TOKEN = "ghp_9kXbT3wQmZr7LpVn2YcHsJ5dGfA8eUoRt1Ki"
OPENAI_KEY = "sk-proj-Qw3rTy7UiOp9AsDfGhJkLzXcVbNm1234QwErTy"
JWT = ("eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9."
       "eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ."
       "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c")


def _same(argv: Sequence[str]) -> None:
    assert redact_cmdline(argv) == tuple(argv)


# -- nothing to hide: byte-identical ------------------------------------------------------------

def test_realistic_torchrun_command_line_is_unchanged() -> None:
    _same([
        "/opt/conda/envs/train/bin/python3.11", "/opt/conda/envs/train/bin/torchrun",
        "--nnodes=4", "--nproc-per-node=8", "--node-rank=2", "--rdzv-id=llama3-70b-sft-0611",
        "--rdzv-backend=c10d", "--rdzv-endpoint=gpu-node-017.cluster.internal:29400",
        "--rdzv-conf=join_timeout=900,read_timeout=120", "--max-restarts=3",
        "--master-port", "29500", "--tee", "3", "--log-dir", "/scratch/logs/torchelastic",
        "train.py", "--config", "configs/llama3_70b.yaml", "--model_name_or_path",
        "meta-llama/Meta-Llama-3-70B", "--dataset", "HuggingFaceH4/ultrachat_200k",
        "--output_dir", "/checkpoints/llama3-70b-sft", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "8", "--learning_rate", "2e-5", "--lr_scheduler_type",
        "cosine", "--warmup_ratio", "0.03", "--bf16", "True", "--tf32", "True",
        "--gradient_checkpointing", "--deepspeed", "ds_zero3.json", "--report_to", "wandb",
        "--run_name", "sft-70b-lr2e-5", "--logging_steps", "10", "--save_strategy", "steps",
        "--max_seq_length", "8192", "--seed", "1234", "--resume_from_checkpoint",
        "/checkpoints/llama3-70b-sft/checkpoint-1200",
    ])


def test_tokenizer_and_dataset_key_options_are_unchanged() -> None:
    _same([
        "python", "-m", "trl.scripts.dpo", "--pad_token", "<|finetune_right_pad_id|>",
        "--eos-token", "</s>", "--bos_token=<s>", "--unk-token", "[UNK]", "--add_eos_token",
        "--use_auth_token", "True", "--dataset_text_field", "text", "--text_key", "content",
        "--chosen_key", "chosen", "--rejected_key", "rejected", "--label_key", "labels",
        "--input_key", "prompt", "--max_new_tokens", "512", "--max-num-batched-tokens", "8192",
        "--pad_token_id", "0", "--skip_special_tokens", "--tokenizer_name_or_path", "gpt2",
        "--hub_model_id", "org/model", "--push_to_hub", "--hub_private_repo",
    ])


def test_vllm_and_hydra_command_lines_are_unchanged() -> None:
    _same(["vllm", "serve", "mistralai/Mistral-7B-Instruct-v0.3", "--tensor-parallel-size", "2",
           "--gpu-memory-utilization", "0.92", "--max-model-len", "32768", "--port", "8000",
           "--tokenizer-mode", "mistral", "--api-key-env", "VLLM_KEY"])
    _same(["python", "train.py", "trainer.devices=8", "model.tokenizer.type=sentencepiece",
           "data.prompt_key=question", "+experiment=llama_7b", "~callbacks.early_stop",
           "optim.lr=3e-4", "logger.wandb.project=sft"])


def test_environment_assignments_without_secrets_are_unchanged() -> None:
    _same(["env", "TOKENIZERS_PARALLELISM=false",
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "NCCL_SOCKET_IFNAME=ib0",
           "HF_HOME=/scratch/hf", "HF_TOKEN_PATH=/run/secrets/hf",
           "KEYBOARD=us", "MONKEY=1", "PWD=/home/alice", "AUTH_TYPE=oauth", "SORT_KEY=len",
           "python", "x.py"])


@pytest.mark.parametrize("argv", [
    ["ssh", "-p", "2222", "gpu-node-01"],
    ["uvicorn", "app:api", "-p", "8000"],
    ["py-spy", "dump", "-p", "48213"],
    ["docker", "run", "-p", "8080:80", "--gpus", "all", "nvcr.io/nvidia/pytorch:24.05-py3"],
    ["mysql", "-u", "root", "-p", "metrics"],
    ["redis-server", "-a", "x"],
    ["tar", "-xpf", "data.tar"],
])
def test_short_flags_are_not_secrets_by_default(argv: list[str]) -> None:
    _same(argv)


@pytest.mark.parametrize("argv", [
    ["git", "clone", "ssh://git@github.com/org/repo.git"],
    ["git", "clone", "git@github.com:org/repo.git"],
    ["curl", "http://[::1]:8080/health"],
    ["wget", "https://huggingface.co/datasets/x/resolve/main/a.parquet?download=true"],
    ["python", "x.py", "--url", "https://host:8443/v1/models@latest"],
])
def test_urls_without_passwords_are_unchanged(argv: list[str]) -> None:
    _same(argv)


@pytest.mark.parametrize("argv", [
    ["python", "run.py", "--run-name", "sk-resnet50-finetune-2024-bs256-lr1e3"],
    ["python", "run.py", "--model", "hf_internal_testing_tiny_random_model_for_ci"],
    ["python", "run.py", "--commit", "3f9a1c0d8e7b6a5f4e3d2c1b0a9f8e7d6c5b4a39"],
    ["python", "run.py", "--id", "ed76b6c7-3a7f-486b-a3f5-7db14b6a8cb4"],
    ["python", "run.py", "--task", "task-0123456789abcdefghijklmnopqrstuvwxyz"],
])
def test_lookalike_identifiers_are_not_token_shapes(argv: list[str]) -> None:
    _same(argv)


def test_values_that_cannot_be_secrets_are_kept() -> None:
    _same(["x", "--token", "$HF_TOKEN", "--password=${DB_PASSWORD}", "--auth", "none",
           "--secret=", "--api-key", "-", "--password", "--verbose"])


def test_switch_flags_do_not_swallow_the_next_argument() -> None:
    _same(["x", "--no-password", "model.bin", "--use-auth-token", "train.py",
           "--password-stdin", "registry.io", "--ask-password", "host"])


def test_empty_argv_gives_empty_tuple() -> None:
    assert redact_cmdline([]) == ()


# -- secrets by name ---------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "expected"), [
    (["huggingface-cli", "login", "--token", "abc"], ["huggingface-cli", "login", "--token", MASK]),
    (["x", "--token=abc"], ["x", f"--token={MASK}"]),
    (["x", "--hf-token", "abc"], ["x", "--hf-token", MASK]),
    (["x", "--hf_token=abc"], ["x", f"--hf_token={MASK}"]),
    (["x", "--hub_token", "abc"], ["x", "--hub_token", MASK]),
    (["x", "--password", "hunter2"], ["x", "--password", MASK]),
    (["x", "--passwd=hunter2"], ["x", f"--passwd={MASK}"]),
    (["x", "--db-password", "hunter2"], ["x", "--db-password", MASK]),
    (["x", "--api-key", "abc"], ["x", "--api-key", MASK]),
    (["x", "--api_key=abc"], ["x", f"--api_key={MASK}"]),
    (["x", "--apiKey", "abc"], ["x", "--apiKey", MASK]),
    (["x", "--secret", "abc"], ["x", "--secret", MASK]),
    (["x", "--client-secret=abc"], ["x", f"--client-secret={MASK}"]),
    (["x", "--access-key", "abc"], ["x", "--access-key", MASK]),
    (["aws", "--aws-secret-access-key", "abc"], ["aws", "--aws-secret-access-key", MASK]),
    (["x", "--auth", "alice:hunter2"], ["x", "--auth", MASK]),
    (["x", "--auth-token", "abc"], ["x", "--auth-token", MASK]),
    (["x", "--credentials", "abc"], ["x", "--credentials", MASK]),
    (["x", "--private-key", "abc"], ["x", "--private-key", MASK]),
    (["x", "--wandb-key", "abc"], ["x", "--wandb-key", MASK]),
    (["x", "--wandb_api_key", "abc"], ["x", "--wandb_api_key", MASK]),
    (["x", "-token", "abc"], ["x", "-token", MASK]),  # Go-style single-dash long flags
    (["x", "-password=abc"], ["x", f"-password={MASK}"]),
    (["java", "-Dspring.datasource.password=abc", "-jar", "a.jar"],
     ["java", f"-Dspring.datasource.password={MASK}", "-jar", "a.jar"]),
    (["x", "--token", "abc def"], ["x", "--token", MASK]),
    (["x", "--token=abc def"], ["x", f"--token={MASK}"]),
    (["x", "--use_auth_token=hf_secretvalue"], ["x", f"--use_auth_token={MASK}"]),
])
def test_secret_flag_values_are_masked_and_flag_names_kept(argv: list[str],
                                                           expected: list[str]) -> None:
    assert redact_cmdline(argv) == tuple(expected)


@pytest.mark.parametrize(("word", "expected"), [
    ("WANDB_API_KEY=0123456789abcdef0123456789abcdef01234567", f"WANDB_API_KEY={MASK}"),
    ("HF_TOKEN=abc", f"HF_TOKEN={MASK}"),
    ("HUGGING_FACE_HUB_TOKEN=abc", f"HUGGING_FACE_HUB_TOKEN={MASK}"),
    ("AWS_SECRET_ACCESS_KEY=abc", f"AWS_SECRET_ACCESS_KEY={MASK}"),
    ("AWS_SESSION_TOKEN=abc", f"AWS_SESSION_TOKEN={MASK}"),
    ("OPENAI_API_KEY=abc", f"OPENAI_API_KEY={MASK}"),
    ("NGC_API_KEY=abc", f"NGC_API_KEY={MASK}"),
    ("PGPASSWORD=abc", f"PGPASSWORD={MASK}"),
    ("MYSQL_PWD=abc", f"MYSQL_PWD={MASK}"),
    ("MLFLOW_TRACKING_PASSWORD=abc", f"MLFLOW_TRACKING_PASSWORD={MASK}"),
    ("DJANGO_SECRET_KEY=abc", f"DJANGO_SECRET_KEY={MASK}"),
    ("SECRET_KEY_BASE=abc", f"SECRET_KEY_BASE={MASK}"),
    ("GOOGLE_APPLICATION_CREDENTIALS=/keys/sa.json", f"GOOGLE_APPLICATION_CREDENTIALS={MASK}"),
    ("BASIC_AUTH=alice:pw", f"BASIC_AUTH={MASK}"),
    ("logger.wandb.api_key=abc", f"logger.wandb.api_key={MASK}"),
    ("+db.password=abc", f"+db.password={MASK}"),
])
def test_secret_assignments_are_masked_and_names_kept(word: str, expected: str) -> None:
    assert redact_cmdline(["env", word, "python", "x.py"]) == ("env", expected, "python", "x.py")


def test_assignments_passed_through_container_env_flags_are_masked() -> None:
    assert redact_cmdline(["docker", "run", "-e", "HF_TOKEN=abc", "--env=WANDB_API_KEY=k",
                           "--build-arg", "NPM_TOKEN=t", "img"]) == (
        "docker", "run", "-e", f"HF_TOKEN={MASK}", f"--env=WANDB_API_KEY={MASK}",
        "--build-arg", f"NPM_TOKEN={MASK}", "img")


def test_a_secret_flag_at_the_end_of_argv_is_kept() -> None:
    _same(["x", "--token"])


def test_a_secret_value_that_looks_like_no_flag_is_masked_even_with_a_dash() -> None:
    assert redact_cmdline(["x", "--password", "-9$k!"]) == ("x", "--password", MASK)


# -- short flags of the tools where they are passwords -----------------------------------------

@pytest.mark.parametrize(("argv", "expected"), [
    (["sshpass", "-p", "pw", "ssh", "-p", "2222", "host"],
     ["sshpass", "-p", MASK, "ssh", "-p", "2222", "host"]),
    (["sudo", "sshpass", "-ppw", "rsync", "a", "b"],
     ["sudo", "sshpass", f"-p{MASK}", "rsync", "a", "b"]),
    (["redis-cli", "-h", "cache", "-a", "pw", "ping"],
     ["redis-cli", "-h", "cache", "-a", MASK, "ping"]),
    (["mysql", "-uroot", "-ppw", "metrics"], ["mysql", "-uroot", f"-p{MASK}", "metrics"]),
    (["/usr/bin/mysqldump", "-ppw", "db"], ["/usr/bin/mysqldump", f"-p{MASK}", "db"]),
    (["docker", "login", "-u", "me", "-p", "pw", "nvcr.io"],
     ["docker", "login", "-u", "me", "-p", MASK, "nvcr.io"]),
    (["podman", "login", "-p=pw", "quay.io"], ["podman", "login", f"-p={MASK}", "quay.io"]),
])
def test_short_password_flags_of_known_tools_are_masked(argv: list[str],
                                                        expected: list[str]) -> None:
    assert redact_cmdline(argv) == tuple(expected)


# -- secrets by place --------------------------------------------------------------------------

@pytest.mark.parametrize(("url", "expected"), [
    ("https://alice:hunter2@git.example.com/org/repo.git",
     f"https://alice:{MASK}@git.example.com/org/repo.git"),
    ("redis://:hunter2@cache:6379/0", f"redis://:{MASK}@cache:6379/0"),
    ("postgresql://ml:p@ss@db.internal:5432/runs", f"postgresql://ml:{MASK}@db.internal:5432/runs"),
    ("mongodb://u:pw@h1:27017,h2:27017/db?replicaSet=rs0",
     f"mongodb://u:{MASK}@h1:27017,h2:27017/db?replicaSet=rs0"),
    ("redis://:a@h1,redis://:b@h2", f"redis://:{MASK}@h1,redis://:{MASK}@h2"),
    ("--db=mysql+pymysql://root:pw@localhost/x", f"--db=mysql+pymysql://root:{MASK}@localhost/x"),
    ("DATABASE_URL=postgres://u:pw@h/db", f"DATABASE_URL=postgres://u:{MASK}@h/db"),
])
def test_url_passwords_are_masked_and_users_kept(url: str, expected: str) -> None:
    assert redact_cmdline(["x", url]) == ("x", expected)


def test_presigned_url_signatures_and_token_parameters_are_masked() -> None:
    url = ("https://bucket.s3.us-east-1.amazonaws.com/ckpt.pt?X-Amz-Algorithm=AWS4-HMAC-SHA256"
           "&X-Amz-Credential=ASIAQWERTYUIOPASDFGH%2F20240611%2Fus-east-1%2Fs3%2Faws4_request"
           "&X-Amz-Date=20240611T000000Z&X-Amz-Expires=3600&X-Amz-Security-Token=IQoJb3JpZ2lu"
           "&X-Amz-Signature=8d2f0c&X-Amz-SignedHeaders=host")
    expected = ("https://bucket.s3.us-east-1.amazonaws.com/ckpt.pt?X-Amz-Algorithm=AWS4-HMAC-SHA256"
                f"&X-Amz-Credential={MASK}&X-Amz-Date=20240611T000000Z&X-Amz-Expires=3600"
                f"&X-Amz-Security-Token={MASK}&X-Amz-Signature={MASK}&X-Amz-SignedHeaders=host")
    assert redact_cmdline(["wget", url]) == ("wget", expected)
    assert redact_cmdline(["curl", "https://blob.core.windows.net/c/x?sv=2022&sig=AbC%3D"]) == (
        "curl", f"https://blob.core.windows.net/c/x?sv=2022&sig={MASK}")
    assert redact_cmdline(["x", "https://h/cb?access_token=abc&state=1"]) == (
        "x", f"https://h/cb?access_token={MASK}&state=1")


def test_authorization_headers_are_masked() -> None:
    assert redact_cmdline(["curl", "-H", "Authorization: Bearer abcdefghijklmnopqrstuvwxyz"]) == (
        "curl", "-H", f"Authorization: Bearer {MASK}")
    assert redact_cmdline(["curl", "-H", "authorization: Basic YWxpY2U6aHVudGVyMg=="]) == (
        "curl", "-H", f"authorization: Basic {MASK}")


def test_secrets_in_inline_json_are_masked() -> None:
    argv = ["python", "x.py", "--cfg", '{"wandb": {"project": "sft", "api_key": "abc123"}}']
    assert redact_cmdline(argv) == (
        "python", "x.py", "--cfg", f'{{"wandb": {{"project": "sft", "api_key": "{MASK}"}}}}')


# -- secrets by shape --------------------------------------------------------------------------

@pytest.mark.parametrize(("secret", "shown"), [
    (HF_TOKEN, f"hf_{MASK}"),
    (GH_TOKEN, f"ghp_{MASK}"),
    ("gho_16C7e42F292c6912E7710c838347Ae178B4a", f"gho_{MASK}"),
    ("github_pat_11ABCDEFG0abcdefghijkl_mnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ012345678",
     f"github_pat_{MASK}"),
    ("glpat-Xy7zAbCdEfGhIjKlMnOp", f"glpat-{MASK}"),
    (OPENAI_KEY, f"sk-{MASK}"),
    ("sk-ant-api03-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Jh1GfEdCbA0-aBcDeFgHiJkLmN_oPqRsTuV", f"sk-{MASK}"),
    ("xoxb-1234567890-0987654321-AbCdEfGhIjKlMnOpQrStUvWx", f"xoxb-{MASK}"),
    ("xoxp-1234567890-abcdef", f"xoxp-{MASK}"),
    ("AKIAIOSFODNN7EXAMPLE", f"AKIA{MASK}"),
    ("ASIAQWERTYUIOPASDFGH", f"ASIA{MASK}"),
    ("AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", f"AIza{MASK}"),
    ("npm_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", f"npm_{MASK}"),
    ("pypi-AgEIcHlwaS5vcmcCJGQ4ZjY2YjQ1LWE2YmMtNDk1", f"pypi-{MASK}"),
    (JWT, MASK),
])
def test_well_known_token_shapes_are_masked_anywhere(secret: str, shown: str) -> None:
    assert redact_cmdline(["x", secret]) == ("x", shown)
    assert redact_cmdline(["x", f"--header=X-Key:{secret}"]) == ("x", f"--header=X-Key:{shown}")
    assert redact_cmdline(["x", f"/tmp/{secret}/log"]) == ("x", f"/tmp/{shown}/log")


def test_token_shape_in_a_url_user_is_masked() -> None:
    assert redact_cmdline(["git", "clone", f"https://{GH_TOKEN}@github.com/org/repo"]) == (
        "git", "clone", f"https://ghp_{MASK}@github.com/org/repo")


# -- shell strings -----------------------------------------------------------------------------

def test_secrets_inside_shell_strings_are_masked_and_layout_kept() -> None:
    script = ("export HF_TOKEN='abc'; WANDB_API_KEY=k  torchrun --nproc-per-node=8 train.py "
              "--hub_token \"xyz\" --lr 1e-4 && curl https://u:pw@h/x")
    expected = (f"export HF_TOKEN='{MASK}'; WANDB_API_KEY={MASK}  torchrun --nproc-per-node=8 "
                f"train.py --hub_token \"{MASK}\" --lr 1e-4 && curl https://u:{MASK}@h/x")
    assert redact_cmdline(["/bin/bash", "-c", script]) == ("/bin/bash", "-c", expected)


def test_shell_string_without_secrets_is_unchanged() -> None:
    _same(["sh", "-c", "cd /work && TOKENIZERS_PARALLELISM=false srun --ntasks=8 python "
                       "train.py --max_new_tokens 512 --pad_token '<pad>' > log.txt 2>&1"])


def test_shell_variable_references_in_scripts_are_kept() -> None:
    _same(["bash", "-c", 'huggingface-cli login --token "$HF_TOKEN" && python x.py'])


def test_shell_string_password_flags_of_known_tools_are_masked() -> None:
    assert redact_cmdline(["sh", "-c", "sshpass -p 'pw' ssh -p 22 host uptime"]) == (
        "sh", "-c", f"sshpass -p '{MASK}' ssh -p 22 host uptime")


def test_retitled_process_with_its_command_line_in_one_argument_is_redacted() -> None:
    assert redact_cmdline(["python train.py --token abc --epochs 3"]) == (
        f"python train.py --token {MASK} --epochs 3",)


# -- robustness --------------------------------------------------------------------------------

def test_redaction_is_idempotent() -> None:
    argv = ["sh", "-c", f"HF_TOKEN=a x --password b https://u:c@h {JWT} {HF_TOKEN}",
            "--token", "d", "AKIAIOSFODNN7EXAMPLE", "redis://:e@h"]
    once = redact_cmdline(argv)
    assert redact_cmdline(once) == once
    assert not any(s in " ".join(once) for s in ("=a ", " b ", ":c@", ":e@", HF_TOKEN, JWT))


def test_odd_argument_types_never_raise() -> None:
    assert redact_cmdline(["x", b"--token", b"\xff\xfe"]) == ("x", "--token", MASK)  # type: ignore[list-item]
    assert redact_cmdline(["x", None, 3]) == ("x", "None", "3")  # type: ignore[list-item]
    assert redact_cmdline("python train.py --token abc") == (f"python train.py --token {MASK}",)
    assert redact_cmdline(None) == ()  # type: ignore[arg-type]


def test_random_arguments_never_raise() -> None:
    rng = random.Random(611)
    pieces = ["--token", "=", "-p", "sshpass", "mysql", "docker", "login", "://", "@", ":", "?",
              "&", "sig=", "'", '"', " ", "\t", "\n", "hf_", "sk-", "eyJ", "$", "{", "}", "<",
              ">", "\x00", "é", "AKIA", "KEY", "_", ".", "Bearer ", "Authorization: ", "-", "a",
              "Z", "9"]
    for _ in range(3000):
        argv = ["".join(rng.choice(pieces) for _ in range(rng.randrange(0, 12)))
                for _ in range(rng.randrange(0, 6))]
        out = redact_cmdline(argv)
        assert len(out) == len(argv)
        assert all(isinstance(s, str) for s in out)


def test_very_long_arguments_are_handled() -> None:
    long = "a" * 200_000
    _same(["x", long, "https://" + "b" * 100_000])
    assert redact_cmdline(["x", "--token", long]) == ("x", "--token", MASK)


def test_an_internal_failure_hides_every_argument_but_a_plain_program(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from gpuwatch.sources import redact

    def broken(words: list[str], shell: bool) -> list[str]:
        raise RuntimeError("bug")

    monkeypatch.setattr(redact, "_redact_words", broken)
    assert redact_cmdline(["/usr/bin/python3", "--token", "abc"]) == (
        "/usr/bin/python3", MASK, MASK)
    assert redact_cmdline(["HF_TOKEN=abc python x.py"]) == (MASK,)


# -- the launch environment ------------------------------------------------------------------

def test_launch_env_values_are_redacted_by_the_command_line_rules() -> None:
    env = {
        "MASTER_ADDR": "https://trainer:s3cr3t-pw@rdzv.example.com:29400",
        "JAX_COORDINATOR_ADDRESS": "grpc://coord:8476/?token=abcdef123456&x=1",
        "TORCHELASTIC_RUN_ID": GH_TOKEN,
        "RAY_JOB_ID": f"Authorization: Bearer {JWT}",
    }
    assert redact_env(env) == {
        "MASTER_ADDR": f"https://trainer:{MASK}@rdzv.example.com:29400",
        "JAX_COORDINATOR_ADDRESS": f"grpc://coord:8476/?token={MASK}&x=1",
        "TORCHELASTIC_RUN_ID": f"ghp_{MASK}",
        "RAY_JOB_ID": f"Authorization: Bearer {MASK}",
    }


def test_launch_env_without_secrets_is_unchanged() -> None:
    env = {"MASTER_ADDR": "10.0.3.17", "MASTER_PORT": "29500", "RANK": "3",
           "TORCHELASTIC_RUN_ID": "llama3-70b-sft-0611", "SLURM_JOB_ID": "41234",
           "CUDA_VISIBLE_DEVICES": "GPU-6f1c3c1e-8a41-4f0b-9a55-2f5b8f0c7d10,MIG-1/2/0",
           "GPUWATCH_RUN_ID": "train-3fa91c", "GPUWATCH_RUN_SUPERVISOR": "5120:1700000000.12",
           "JAX_COORDINATOR_ADDRESS": "coord-0.svc:8476", "EMPTY": ""}
    assert redact_env(env) == env
    assert redact_env(redact_env({"MASTER_ADDR": "tcp://u:p@h:1"})) == {
        "MASTER_ADDR": f"tcp://u:{MASK}@h:1"}


def test_a_secret_named_variable_is_masked_whole_and_a_failure_masks_the_value(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert redact_env({"HF_TOKEN": "abc", "X": "1"}) == {"HF_TOKEN": MASK, "X": "1"}
    from gpuwatch.sources import redact

    def broken(words: list[str], shell: bool) -> list[str]:
        raise RuntimeError("bug")

    monkeypatch.setattr(redact, "_redact_words", broken)
    assert redact_env({"MASTER_ADDR": "10.0.0.1"}) == {"MASTER_ADDR": MASK}


def test_a_real_process_s_launch_env_is_shown_redacted(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """MASTER_ADDR with a password and a token-shaped run id, read from /proc/PID/environ: masked
    in `status --json` (launch_env, and the job id taken from it) and in `gpuwatch status`."""
    from tests.realprocs import gpuwatch

    secret_addr = "https://user:secret-pw-42@rdzv.example.com:29400"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "RANK")}
    env.update({"MASTER_ADDR": secret_addr, "RANK": "0", "TORCHELASTIC_RUN_ID": GH_TOKEN})
    worker = subprocess.Popen(["sleep", "60"], env=env)
    try:
        fake_node.hold(worker.pid, device=0, used=1 << 30)
        result = gpuwatch(["status", "--poll", "--json"], cli_env)
        assert "secret-pw-42" not in result.stdout and GH_TOKEN not in result.stdout
        doc = json.loads(result.stdout)
        (p,) = [p for p in doc["processes"] if p["pid"] == worker.pid]
        assert p["launch_env"]["MASTER_ADDR"] == f"https://user:{MASK}@rdzv.example.com:29400"
        assert p["launch_env"]["TORCHELASTIC_RUN_ID"] == f"ghp_{MASK}"
        assert p["launch_env"]["RANK"] == "0"
        assert p["job"] == {"id": f"ghp_{MASK}", "source": "torchelastic"}
        table = gpuwatch(["status", "--poll"], cli_env).stdout
        assert "secret-pw-42" not in table and GH_TOKEN not in table
        (row,) = [line for line in table.splitlines()
                  if str(worker.pid) in line.split() and "sleep" in line]
        assert f"torchelastic:ghp_{MASK}" in row
    finally:
        worker.kill()
        worker.wait()


# -- second round: short password options, bare --key, provider key shapes ----------------------

@pytest.mark.parametrize(("argv", "expected"), [
    # short password options of known tools
    (["mongosh", "-u", "admin", "-p", "pSECRET9", "db"],
     ["mongosh", "-u", "admin", "-p", MASK, "db"]),
    (["ipmitool", "-I", "lanplus", "-H", "bmc1", "-U", "admin", "-P", "calvin", "power", "status"],
     ["ipmitool", "-I", "lanplus", "-H", "bmc1", "-U", "admin", "-P", MASK, "power", "status"]),
    (["sqlcmd", "-S", "db", "-U", "sa", "-P", "Str0ng!"],
     ["sqlcmd", "-S", "db", "-U", "sa", "-P", MASK]),
    (["zip", "-P", "hunter2", "out.zip", "a"], ["zip", "-P", MASK, "out.zip", "a"]),
    (["7z", "a", "-phunter2", "x.7z", "d"], ["7z", "a", f"-p{MASK}", "x.7z", "d"]),
    (["ldapsearch", "-x", "-D", "cn=admin", "-w", "hunter2", "-b", "dc=x"],
     ["ldapsearch", "-x", "-D", "cn=admin", "-w", MASK, "-b", "dc=x"]),
    (["mosquitto_pub", "-u", "u", "-P", "hunter2", "-t", "t"],
     ["mosquitto_pub", "-u", "u", "-P", MASK, "-t", "t"]),
    (["rabbitmqadmin", "-u", "guest", "-p", "guest", "list", "queues"],
     ["rabbitmqadmin", "-u", "guest", "-p", MASK, "list", "queues"]),
    (["redis-cli", "-a", "pSECRET9"], ["redis-cli", "-a", MASK]),
    (["curl", "-u", "alice:hunter2", "https://h/x"], ["curl", "-u", f"alice:{MASK}", "https://h/x"]),
    (["curl", "--user", "alice:hunter2", "https://h/x"],
     ["curl", "--user", f"alice:{MASK}", "https://h/x"]),
    (["smbclient", "//h/s", "-U", "alice%hunter2"], ["smbclient", "//h/s", "-U", f"alice%{MASK}"]),
    (["openssl", "enc", "-aes256", "-k", "hunter2"], ["openssl", "enc", "-aes256", "-k", MASK]),
    (["openssl", "pkcs12", "-passin", "pass:hunter2"], ["openssl", "pkcs12", "-passin", MASK]),
    # -p / -P of any other program, when the value is shaped like a password
    (["x", "-p", "pSECRET9"], ["x", "-p", MASK]),
    (["python", "worker.py", "-P", "Hunter2xyz"], ["python", "worker.py", "-P", MASK]),
    # secret names: bare --key, --pass, --passphrase, --pw
    (["x", "--key", "sk-liveSECRET15"], ["x", "--key", MASK]),
    (["x", "--key=abc"], ["x", f"--key={MASK}"]),
    (["x", "--pass", "abc"], ["x", "--pass", MASK]),
    (["x", "--pw", "abc"], ["x", "--pw", MASK]),
    (["x", "--passphrase", "abc def"], ["x", "--passphrase", MASK]),
    (["x", "--api-key", "sk-liveSECRET15"], ["x", "--api-key", MASK]),
    (["x", "--secret", "sk-liveSECRET15"], ["x", "--secret", MASK]),
])
def test_short_password_options_and_bare_key_flags_are_masked(argv: list[str],
                                                             expected: list[str]) -> None:
    assert redact_cmdline(argv) == tuple(expected)


@pytest.mark.parametrize("argv", [
    ["python", "-P", "train.py"],           # python's own -P (safe path), a switch
    ["ssh", "-p", "2222", "host"],
    ["scp", "-P", "2222", "a", "h:b"],
    ["docker", "run", "-p", "8080:80", "img"],
    ["mkdir", "-p", "/scratch/Run1/ckpt"],
    ["grep", "-P", r"\d+ loss", "log"],
    ["xargs", "-P", "8", "-n", "1"],
    ["wget", "-P", "downloads", "https://h/x"],
    ["ps", "-p", "12345"],
    ["uvicorn", "app:api", "-p", "8000"],
    ["mysql", "-u", "root", "-p", "Metrics2024"],  # mysql's -p alone prompts: the next is the db
    ["curl", "-u", "alice", "https://h/x"],        # no password given: curl prompts
    ["x", "--text-key", "content", "--first-pass", "abc", "--pw-file", "/run/pw"],
    ["sort", "--key-field", "2"],
    ["zip", "-r", "out.zip", "Dir1"],
])
def test_short_options_and_key_words_that_are_not_passwords_are_unchanged(argv: list[str]) -> None:
    _same(argv)


@pytest.mark.parametrize(("secret", "shown"), [
    ("sk_live_51HxYzAbCdEfGhIjKlMnOpQr", f"sk_live_{MASK}"),   # Stripe secret and restricted
    ("rk_test_51HxYzAbCdEfGhIjKlMnOpQr", f"rk_test_{MASK}"),
    ("xoxe-1-AbCdEfGhIjKlMnOp123", f"xoxe-{MASK}"),             # Slack refresh tokens
    ("xapp-1-A012BCDEF-1234567890-abcdef0123", f"xapp-{MASK}"),  # Slack app-level tokens
    ("nvapi-Ab3dEfGh1jKlMnOpQrStUvWxYz0123456789AbCdEfGhIjKlMnOpQr", f"nvapi-{MASK}"),  # NGC
    ("gsk_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789AbCdEfGhIjKl", f"gsk_{MASK}"),
    ("r8_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", f"r8_{MASK}"),
    ("glc_eyJvIjoiMTIzNDU2IiwibiI6InN0YWNrLTEyMzQ1Ni1obS1yZWFkIn0=", f"glc_{MASK}"),
    ("AKIAIOSFODNN7EXAMPLE", f"AKIA{MASK}"),
    ("ghp_9kXbT3wQmZr7LpVn2YcHsJ5dGfA8eUoRt1Ki", f"ghp_{MASK}"),
])
def test_provider_key_shapes_are_masked_anywhere(secret: str, shown: str) -> None:
    assert redact_cmdline(["x", secret]) == ("x", shown)
    assert redact_cmdline(["x", f"--header=X-Key:{secret}"]) == ("x", f"--header=X-Key:{shown}")
