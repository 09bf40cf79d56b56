"""One module per trainable drafter kind (its module, loss, features and options), each exporting
`KIND`; verispec.training.recipes.RECIPES registers them."""
