"""Tests of llmtrain/preference/: pairs, the preference losses, the reference."""
