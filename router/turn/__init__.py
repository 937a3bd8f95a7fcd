"""One conversation turn: the request as read, the decision core, and the steps that apply it."""
