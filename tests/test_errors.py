"""The gist of a library's exception, in one line."""

from llmtrain.errors import describe


def test_describe_gives_the_first_line_and_what_a_colon_announces():
    assert describe(ValueError("")) == "ValueError"
    assert describe(ValueError("\n  bad value\nmore detail\n")) == "ValueError: bad value"
    message = "Couldn't instantiate the backend tokenizer from one of: \n(1) a file, \n(2) a slow one"
    assert describe(ValueError(message)) == (
        "ValueError: Couldn't instantiate the backend tokenizer from one of: (1) a file, (2) a slow one"
    )
