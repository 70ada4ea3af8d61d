"""The champion's drafter: a draft head on the target's hidden state, distilled on the target's own answers
(compress/draft/stage.py build_drafter; served by serve/engine/draft_head.py)."""
