"""Each `lm` command's parser (`register`) and function, by job; `lm.cli` gathers them."""
