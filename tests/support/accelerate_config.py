"""`accelerate config` answered without a terminal: `answer` drives Accelerate's own
questionnaire with (question, answer) pairs, checking each question it asks against the one
the answer is for, and returns the config it would write; MULTI_CPU_ANSWERS are the answers
that start one process where two are named (a multi-CPU machine without mpirun), and
MULTI_CPU_CONFIG the file `accelerate config` writes from them."""

from __future__ import annotations

MULTI_CPU_ANSWERS = [
    ("In which compute environment are you running?", "This machine"),
    ("Which type of machine are you using?", "multi-CPU"),
    ("How many different machines will you use", "1"),
    ("Should distributed operations be checked while running for errors?", "no"),
    ("Do you want accelerate to launch mpirun?", "no"),
    ("Do you wish to optimize your script with torch dynamo?", "no"),
    ("How many processes should be used for distributed training?", "2"),
    ("Do you wish to use mixed precision?", "no"),
]
MULTI_CPU_CONFIG = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def answer(monkeypatch, answers: list[tuple[str, str]]):
    """The config (Accelerate's ClusterConfig) `accelerate config` makes from `answers`,
    given in the order it asks; a question asked that is not the next one answered, or an
    answer left over, fails the test."""
    import accelerate.commands.config.cluster as cluster
    import accelerate.commands.config.config as top

    left = list(answers)

    def given(text: str) -> str:
        assert left, f"accelerate config asks {text!r}, which is not answered"
        question, reply = left.pop(0)
        assert text.strip().startswith(question), f"accelerate config asks {text!r}, the answer is for {question!r}"
        return reply

    def ask_options(text, options=(), convert_value=None, default=0):
        index = list(options).index(given(text))
        return convert_value(index) if convert_value else index

    def ask_field(text, convert_value=None, default=None, error_message=None):
        reply = given(text)
        return convert_value(reply) if convert_value else reply

    for module in (cluster, top):
        monkeypatch.setattr(module, "_ask_options", ask_options)
    monkeypatch.setattr(cluster, "_ask_field", ask_field)
    config = top.get_user_input()
    assert not left, f"accelerate config did not ask {[q for q, _ in left]}"
    return config
