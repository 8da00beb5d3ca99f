"""Hostile and mistyped values of a job description (issue 51, item 3): each is refused in one
line that names the key and the value, or quoted so that the sbatch script and the PyTorchJob
manifest run exactly the lines dtrain writes."""

from __future__ import annotations

import shlex

import pytest

from dtrain import ConfigError
from dtrain.cli import main as cli_main
from dtrain.launch import jobspec, k8s, sbatch
from dtrain.launch.jobvalues import sbatch_arg

HOSTILE = ["x\ntouch INJECTED", "x\rtouch INJECTED", "x; touch INJECTED", "$(touch INJECTED)", "`touch INJECTED`",
           "x' ; touch INJECTED ; '", 'x" # touch INJECTED', "a\\b c"]
#: Where a value goes: (field of with_overrides, how a hostile value is placed there).
FREE_TEXT = {
    "workdir": lambda v: {"workdir": v},
    "output": lambda v: {"slurm_output": v},
    "extra": lambda v: {"slurm_extra": (f"--comment={v}",)},
    "env value": lambda v: {"env": {"A": v}},
    "command": lambda v: {"command": ("train.py", "--note", v)},
    "dtrain": lambda v: {"dtrain": ("python3", "-m", "dtrain", v)},
}
NAMES = {
    "name": lambda v: {"name": v},
    "partition": lambda v: {"slurm_partition": v},
    "account": lambda v: {"slurm_account": v},
    "qos": lambda v: {"slurm_qos": v},
    "env key": lambda v: {"env": {v: "1"}},
}
BASE = jobspec.JobSpec(name="hostile", command=("train.py",), k8s=jobspec.K8sOptions(image="me/train:1"))


def sbatch_words(text: str) -> list[str]:
    """The arguments sbatch reads from what follows ``#SBATCH``: slurm's ``_get_argument``
    (src/sbatch/opt.c), rewritten: whitespace splits, quotes group, a backslash escapes the next
    character, an unquoted '#' ends the line."""
    words, i = [], 0
    while i < len(text):
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            break
        word, quote = "", ""
        while i < len(text) and (quote or not text[i].isspace()):
            c = text[i]
            if c == "\\" and i + 1 < len(text):
                word, i = word + text[i + 1], i + 2
                continue
            if quote:
                if c == quote:
                    quote = ""
                else:
                    word += c
            elif c in "'\"":
                quote = c
            elif c == "#":
                return [*words, word] if word else words
            else:
                word += c
            i += 1
        assert not quote, f"unmatched quote in #SBATCH {text}"
        words.append(word)
    return words


def script_runs_only_what_dtrain_wrote(job: jobspec.JobSpec) -> list[str]:
    """Each line of the script is a comment, an #SBATCH line that sbatch reads as one option, or
    one of the commands dtrain writes, whose words the shell reads back as the job's. Returns the
    sbatch options as sbatch reads them."""
    lines = sbatch.render(job, source="job.toml").splitlines()
    options = [sbatch_words(line[len("#SBATCH "):]) for line in lines if line.startswith("#SBATCH ")]
    assert all(len(words) == 1 for words in options), options
    commands = [line for line in lines if line and not line.startswith("#")]
    exports = [["export", f"{k}={v}"] for k, v in sbatch.job_env(job).items()]
    assert commands[0] == "set -euo pipefail", commands
    assert [shlex.split(c) for c in commands[1:1 + len(exports)]] == exports
    assert commands[1 + len(exports):-2] == list(job.slurm.setup) and commands[-2].startswith('echo "dtrain: job')
    assert len(commands) == len(exports) + len(job.slurm.setup) + 3
    assert shlex.split(commands[-1]) == sbatch.srun_argv(job)
    return [words[0] for words in options]


#: The sbatch option a free-text value becomes (None: it goes to the shell, not to sbatch).
AS_OPTION = {"workdir": "--chdir={}", "output": "--output={}", "extra": "--comment={}"}


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("where", sorted(FREE_TEXT))
def test_free_text_is_quoted_or_refused(where, value):
    try:
        job = jobspec.with_overrides(BASE, **FREE_TEXT[where](value))
    except ConfigError as exc:
        assert "\n" in value or "\r" in value, f"{where} {value!r} refused: {exc}"
        assert "line break" in str(exc) and "\n" not in str(exc)
        return
    assert "\n" not in value and "\r" not in value  # a line break always ends in a refusal
    options = script_runs_only_what_dtrain_wrote(job)
    if where in AS_OPTION:
        assert AS_OPTION[where].format(value) in options
    container = k8s.render(job)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert shlex.split(container["command"][2]) == [
        "exec", *job.dtrain, "run", "-n", "1", "--nnodes", "1", "--node-rank", "0", "--master-addr", "$DTRAIN_POD_IP",
        "--master-port", "29500", *job.command]


@pytest.mark.parametrize("value", HOSTILE)
@pytest.mark.parametrize("where", sorted(NAMES))
def test_names_are_refused_unless_the_scheduler_takes_them(where, value):
    with pytest.raises(ConfigError) as info:
        jobspec.with_overrides(BASE, **NAMES[where](value))
    message = str(info.value)
    assert "\n" not in message and repr(value)[1:-1][:20] in message


def test_a_workdir_with_spaces_is_one_chdir_argument():
    job = jobspec.with_overrides(BASE, workdir="/scratch/my runs/mnist")
    text = sbatch.render(job)
    assert '#SBATCH "--chdir=/scratch/my runs/mnist"' in text.splitlines()
    assert sbatch_words('"--chdir=/scratch/my runs/mnist"') == ["--chdir=/scratch/my runs/mnist"]
    script_runs_only_what_dtrain_wrote(job)
    assert k8s.render(job)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["workingDir"] == \
        "/scratch/my runs/mnist"


def test_plain_options_stay_as_they_were():
    assert [sbatch_arg(o) for o in ("--partition=gpu,cpu", "--signal=USR1@90", "--output=%x-%j.out", "--gres=gpu:2")] == \
        ["--partition=gpu,cpu", "--signal=USR1@90", "--output=%x-%j.out", "--gres=gpu:2"]


@pytest.mark.parametrize("values, expect", [
    ({"name": "mnist\n"}, "job name 'mnist\\n' may hold only"),     # re's $ matched before a trailing newline
    ({"env": {"NCCL_DEBUG\n": "1"}}, "[env] 'NCCL_DEBUG\\n' is not an environment variable name"),
    ({"time": "90\n"}, "time '90\\n' is not a time limit"),
    ({"slurm_extra": ("exclusive",)}, "[slurm] extra[0] 'exclusive' is not an sbatch option"),
    ({"slurm_signal_before_s": -1}, "[slurm] signal_before_s must be within 0..65535, got -1"),
    ({"k8s_port": 0}, "[k8s] port must be within 1..65535, got 0"),
    ({"k8s_port": 65536}, "[k8s] port must be within 1..65535, got 65536"),
    ({"k8s_namespace": "Team_A"}, "[k8s] namespace 'Team_A' is not a Kubernetes name"),
    ({"k8s_namespace": "a" * 64}, "at most 63 characters"),
    ({"k8s_image": "me/train:1 --privileged"}, "[k8s] image 'me/train:1 --privileged' holds a space"),
    ({"k8s_image_pull_policy": "always"}, "choose one of: Always, IfNotPresent, Never"),
    ({"k8s_backoff_limit": -1}, "[k8s] backoff_limit must be within"),
    ({"workdir": ""}, "workdir is empty"),
])
def test_values_the_scheduler_would_not_take(values, expect):
    with pytest.raises(ConfigError) as info:
        jobspec.with_overrides(BASE, **values)
    assert expect in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("toml, expect", [
    ('name = 5\ncommand = ["train.py"]', "j.toml: name must be a string, got 5 (int)"),
    ("command = 5", "j.toml: command must be a list of strings, got 5 (int)"),
    ('command = ["train.py", 1]', "j.toml: command[1] must be a string, got 1 (int)"),
    ('command = "train.py \'unclosed"', "command \"train.py 'unclosed\" cannot be split into words"),
    ('command = ["train.py"]\ngpus_per_node = true', "gpus_per_node must be a whole number, got True (bool)"),
    ('command = ["train.py"]\nprocs_per_node = 2.0', "procs_per_node must be a whole number, got 2.0 (float)"),
    ('command = ["train.py"]\ntime = 02:00:00', 'time must be a string, got datetime.time(2, 0) (time); write e.g. time = "02:00:00"'),
    ('command = ["train.py"]\nenv = "A=1"', "env must be a table of NAME = \"value\", got 'A=1' (str)"),
    ('command = ["train.py"]\n[env]\nA = true', "env.A must be a string, got True (bool)"),
    ('command = ["train.py"]\nslurm = 5', "[slurm] must be a table, got 5"),
    ('command = ["train.py"]\n[slurm]\nrequeue = "no"', "[slurm] requeue must be true or false, got 'no' (str)"),
    ('command = ["train.py"]\n[slurm]\nsignal_before_s = -90', "[slurm] signal_before_s must be within 0..65535, got -90"),
    ('command = ["train.py"]\n[slurm]\npartition = 7', "[slurm] partition must be a string, got 7 (int)"),
    ('command = ["train.py"]\n[slurm]\nsetup = [1]', "[slurm] setup[0] must be a string, got 1 (int)"),
    ('command = ["train.py"]\n[k8s]\nport = -1', "[k8s] port must be within 1..65535, got -1"),
    ('command = ["train.py"]\n[k8s]\nport = "29500"', "[k8s] port must be a whole number, got '29500' (str)"),
    ('command = ["train.py"]\n[k8s]\nnamespace = "My Team"', "[k8s] namespace 'My Team' is not a Kubernetes name"),
    ('command = ["train.py"]\nnodes = "\u00b2"', "nodes '\u00b2' is not a number of nodes"),
])
def test_wrong_types_in_a_job_file_are_one_line(tmp_path, toml, expect):
    path = tmp_path / "j.toml"
    path.write_text(toml + "\n")
    with pytest.raises(ConfigError) as info:
        jobspec.load(path)
    assert expect in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_numbers_in_env_are_strings_and_a_good_file_loads(tmp_path):
    path = tmp_path / "j.toml"
    path.write_text('command = "train.py --lr 0.1"\nworkdir = "/a b"\n[env]\nNCCL_IB_TIMEOUT = 22\n[slurm]\nrequeue = false\n'
                    'partition = "gpu,gpu-long"\nsignal_before_s = 0\n[k8s]\nnamespace = "team-a"\nport = 1\n')
    job = jobspec.load(path)
    assert job.env == {"NCCL_IB_TIMEOUT": "22"} and job.command == ("train.py", "--lr", "0.1")
    lines = sbatch.render(job).splitlines()
    assert "#SBATCH --requeue" not in lines and "#SBATCH --partition=gpu,gpu-long" in lines
    assert not any(line.startswith("#SBATCH --signal") for line in lines)


def test_a_hostile_partition_flag_writes_no_script(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = cli_main(["submit", "--slurm", "--partition", "gpu\ntouch INJECTED", "--out", "job.sbatch", "--", "train.py"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("dtrain: error: [slurm] partition 'gpu\\ntouch INJECTED' is not a SLURM name")
    assert not (tmp_path / "job.sbatch").exists()


def test_an_unclosed_quote_in_dtrain_cmd_is_one_line(capsys):
    code = cli_main(["submit", "--slurm", "--dry-run", "--dtrain-cmd", "python3 '-m dtrain", "--", "train.py"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == ("dtrain: error: --dtrain-cmd \"python3 '-m dtrain\" cannot be split into words "
                                 "(no closing quotation); close the quote."), err


def test_the_job_files_path_stays_in_its_comment():
    text = sbatch.render(BASE, source="jobs/a\ntouch INJECTED.toml")
    assert "# Written by `dtrain submit --slurm jobs/a\\ntouch INJECTED.toml`" in text
    assert "touch INJECTED" not in [line.strip() for line in text.splitlines()]
